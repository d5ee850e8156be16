/* GGUF reader: the golden files, every getter, and one crafted file per class of malformed input. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "tests/gguf_bytes.h"
#include "tests/harness.h"

#define GOLDEN_Q4 "tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf"
#define GOLDEN_F16 "tests/golden/models/tiny-qwen3moe-F16.gguf"
#define GOLDEN_Q8 "tests/golden/models/tiny-qwen3moe-Q8_0.gguf"
#define GOLDEN_VOCAB "tests/golden/tokenizer/qwen3-vocab.gguf"

static struct gguf_file *open_ok(const char *path)
{
    char err[512];
    struct gguf_file *f = NULL;
    int rc = gguf_open(&f, path, err, sizeof err);
    CHECK_MSG(rc == 0, "gguf_open(%s): %d %s", path, rc, err);
    return f;
}

TEST(gguf_golden_q4_k_m)
{
    struct gguf_file *f = open_ok(GOLDEN_Q4);
    char err[256];
    CHECK_EQ(f->version, 3);
    CHECK_EQ(f->n_kv, 27);
    CHECK_EQ(f->n_tensors, 39);
    CHECK_EQ(f->alignment, 32);
    CHECK_EQ(f->data_offset, 131072); /* tensor infos end at 131069, padded to 32 */

    struct gguf_str s;
    CHECK_EQ(gguf_get_str(f, "general.architecture", &s, err, sizeof err), 0);
    CHECK(s.len == 8 && !memcmp(s.p, "qwen3moe", 8));
    uint32_t u;
    CHECK_EQ(gguf_get_u32(f, "qwen3moe.block_count", &u, err, sizeof err), 0);
    CHECK_EQ(u, 3);
    CHECK_EQ(gguf_get_u32(f, "qwen3moe.attention.key_length", &u, err, sizeof err), 0);
    CHECK_EQ(u, 64);
    CHECK_EQ(gguf_get_u32(f, "tokenizer.ggml.eos_token_id", &u, err, sizeof err), 0);
    CHECK_EQ(u, 4098);
    float x;
    CHECK_EQ(gguf_get_f32(f, "qwen3moe.rope.freq_base", &x, err, sizeof err), 0);
    CHECK_NEAR(x, 1e6, 0);
    CHECK_EQ(gguf_get_f32(f, "qwen3moe.attention.layer_norm_rms_epsilon", &x, err, sizeof err), 0);
    CHECK_NEAR(x, 1e-6, 1e-12);
    bool b = true;
    CHECK_EQ(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b, err, sizeof err), 0);
    CHECK(!b);

    const struct gguf_kv *kv;
    CHECK_EQ(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 4160);
    CHECK(kv->v.arr.strs[0].len == 1 && kv->v.arr.strs[0].p[0] == '!');
    CHECK_EQ(gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 3840);
    CHECK(kv->v.arr.strs[2].len == 3 && !memcmp(kv->v.arr.strs[2].p, "i n", 3));
    CHECK_EQ(gguf_get_arr(f, "tokenizer.ggml.token_type", GGUF_I32, &kv, err, sizeof err), 0);
    CHECK_EQ(gguf_arr_i64(kv, 0), 1);
    CHECK_EQ(gguf_arr_i64(kv, 4098), 3); /* <|im_end|> is a control token */

    const struct gguf_tensor *t = gguf_find_tensor(f, "blk.0.ffn_down_exps.weight");
    CHECK(t);
    CHECK_EQ(t->n_dims, 3);
    CHECK_EQ(t->ne[0], 128);
    CHECK_EQ(t->ne[1], 256);
    CHECK_EQ(t->ne[2], 16);
    CHECK_EQ(t->ne[3], 1);
    CHECK_EQ(t->type, MOE_TYPE_Q5_0);
    CHECK_EQ(t->offset, 1585792);
    CHECK_EQ(t->nbytes, 128 / 32 * 22 * 256 * 16);
    CHECK(t->data == f->base + f->data_offset + t->offset);
    t = gguf_find_tensor(f, "blk.2.ffn_down_exps.weight");
    CHECK(t && t->type == MOE_TYPE_Q8_0);
    t = gguf_find_tensor(f, "output.weight");
    CHECK(t && t->type == MOE_TYPE_Q6_K && t->ne[0] == 256 && t->ne[1] == 4160);
    CHECK_EQ(t->nbytes, 4160 * 210);
    t = gguf_find_tensor(f, "output_norm.weight");
    CHECK(t && t->type == MOE_TYPE_F32 && t->n_dims == 1 && t->ne[0] == 256 && t->ne[1] == 1);
    CHECK(gguf_find_tensor(f, "blk.3.attn_q.weight") == NULL);
    CHECK(gguf_find_tensor(f, "") == NULL);
    CHECK(gguf_find_kv(f, "qwen3moe.nope") == NULL);
    /* The last tensor ends exactly at the end of the file. */
    t = gguf_find_tensor(f, "blk.2.ffn_up_exps.weight");
    CHECK_EQ(f->data_offset + t->offset + t->nbytes, f->size);
    gguf_close(f);
}

TEST(gguf_golden_all_models_agree)
{
    /* The three quantizations share metadata except file_type, and all tensor names/shapes. */
    struct gguf_file *a = open_ok(GOLDEN_F16), *b = open_ok(GOLDEN_Q8), *c = open_ok(GOLDEN_Q4);
    CHECK_EQ(a->n_tensors, c->n_tensors);
    CHECK_EQ(b->n_tensors, c->n_tensors);
    for (uint64_t i = 0; i < c->n_tensors; i++) {
        const struct gguf_tensor *tc = &c->tensors[i];
        const struct gguf_tensor *ta = gguf_find_tensor(a, tc->name);
        const struct gguf_tensor *tb = gguf_find_tensor(b, tc->name);
        CHECK_MSG(ta && tb, "%s missing", tc->name);
        for (int d = 0; d < 4; d++) {
            CHECK_EQ(ta->ne[d], tc->ne[d]);
            CHECK_EQ(tb->ne[d], tc->ne[d]);
        }
        CHECK(ta->type == MOE_TYPE_F16 || ta->type == MOE_TYPE_F32);
        CHECK(tb->type == MOE_TYPE_Q8_0 || tb->type == MOE_TYPE_F32);
        CHECK_EQ(ta->nbytes, moe_row_bytes(ta->type, ta->ne[0]) * ta->ne[1] * ta->ne[2] * ta->ne[3]);
    }
    /* Different tensor types and offsets give different fingerprints; reopening gives the same. */
    CHECK(gguf_fingerprint(a) != gguf_fingerprint(b));
    CHECK(gguf_fingerprint(b) != gguf_fingerprint(c));
    struct gguf_file *c2 = open_ok(GOLDEN_Q4);
    CHECK(gguf_fingerprint(c) == gguf_fingerprint(c2));
    gguf_close(a);
    gguf_close(b);
    gguf_close(c);
    gguf_close(c2);
}

TEST(gguf_golden_vocab_only)
{
    struct gguf_file *f = open_ok(GOLDEN_VOCAB);
    char err[256];
    CHECK_EQ(f->n_tensors, 0);
    CHECK_EQ(f->n_kv, 12);
    const struct gguf_kv *kv;
    CHECK_EQ(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 151936);
    CHECK_EQ(gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 151387);
    uint32_t u;
    CHECK_EQ(gguf_get_u32(f, "tokenizer.ggml.eos_token_id", &u, err, sizeof err), 0);
    CHECK_EQ(u, 151645);
    struct gguf_str s;
    CHECK_EQ(gguf_get_str(f, "tokenizer.ggml.pre", &s, err, sizeof err), 0);
    CHECK(s.len == 5 && !memcmp(s.p, "qwen2", 5));
    CHECK_EQ(gguf_get_str(f, "tokenizer.chat_template", &s, err, sizeof err), 0);
    CHECK(s.len > 100);
    CHECK(gguf_find_tensor(f, "token_embd.weight") == NULL);
    gguf_close(f);
}

/* ---- crafted files ----------------------------------------------------------------------- */

/* Opens b and checks the error code and that the message contains each needle (the field and,
 * where one applies, its byte offset). */
static void expect_bad(const struct gb *b, int code, const char *n1, const char *n2)
{
    char err[512] = "";
    struct gguf_file *f = NULL;
    int rc = gguf_open_mem(&f, b->p, b->n, err, sizeof err);
    CHECK_MSG(rc == code, "rc %d (%s), expected %d", rc, err, code);
    CHECK(f == NULL);
    CHECK_MSG(!n1 || strstr(err, n1), "message \"%s\" lacks \"%s\"", err, n1);
    CHECK_MSG(!n2 || strstr(err, n2), "message \"%s\" lacks \"%s\"", err, n2);
}

static struct gguf_file *open_mem_ok(const struct gb *b)
{
    char err[512] = "";
    struct gguf_file *f = NULL;
    int rc = gguf_open_mem(&f, b->p, b->n, err, sizeof err);
    CHECK_MSG(rc == 0, "rc %d: %s", rc, err);
    return f;
}

/* A file with one KV and one tensor described by the arguments, data padded to 32 and
 * data_bytes of data. */
static void one_tensor(struct gb *b, const char *name, uint32_t n_dims, const int64_t *ne,
                       uint32_t type, uint64_t offset, size_t data_bytes)
{
    gb_header(b, 3, 1, 1);
    gb_kv_str(b, "general.architecture", "qwen3moe");
    gb_tensor(b, name, n_dims, ne, type, offset);
    gb_pad(b, 32);
    gb_zeros(b, data_bytes);
}

TEST(gguf_rejects_bad_magic)
{
    struct gb b = {0};
    gb_bytes(&b, "GGML", 4);
    gb_u32(&b, 3);
    gb_u64(&b, 0);
    gb_u64(&b, 0);
    expect_bad(&b, MOE_EFORMAT, "magic at byte 0", "not \"GGUF\"");
    gb_free(&b);
}

TEST(gguf_rejects_truncated_header)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 0);
    uint8_t *full = b.p;
    /* Every prefix of the 24-byte header names the field that is cut. */
    const char *field[24];
    for (int i = 0; i < 24; i++)
        field[i] = i < 4 ? "magic at byte 0" : i < 8 ? "version at byte 4"
                 : i < 16 ? "n_tensors at byte 8" : "n_kv at byte 16";
    for (size_t n = 0; n < 24; n++) {
        struct gb p = {full, n, n};
        expect_bad(&p, MOE_EFORMAT, field[n], "truncated");
    }
    /* The complete header alone is a valid, empty file. */
    struct gguf_file *f = open_mem_ok(&b);
    CHECK_EQ(f->n_kv, 0);
    CHECK_EQ(f->n_tensors, 0);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_rejects_every_truncation)
{
    /* Cutting a valid model file anywhere gives an error, never a crash or a success. */
    struct gb b = {0};
    gb_model(&b, (struct gb_model_opts){.n_layer = 1, .with_vocab = 1, .wtype = MOE_TYPE_F16});
    struct gguf_file *f = open_mem_ok(&b);
    uint64_t data_start = f->data_offset;
    gguf_close(f);
    /* Every cut inside the metadata; inside the tensor data every 7th byte and the last 40 (all of
     * those hit the same end-of-file check). */
    for (size_t n = 0; n < b.n; n += n < data_start || n + 40 >= b.n ? 1 : 7) {
        char err[512];
        struct gguf_file *g = NULL;
        uint8_t *copy = malloc(n ? n : 1); /* exact-size copy so ASan sees overreads */
        memcpy(copy, b.p, n);
        int rc = gguf_open_mem(&g, copy, n, err, sizeof err);
        CHECK_MSG(rc == MOE_EFORMAT, "prefix %zu: rc %d (%s)", n, rc, err);
        CHECK(strstr(err, "byte") || strstr(err, "past the end"));
        free(copy);
    }
    gb_free(&b);
}

TEST(gguf_rejects_truncated_kv)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 2);
    gb_kv_u32(&b, "a.b", 7);
    gb_key(&b, "qwen3moe.block_count", GGUF_U32);
    gb_bytes(&b, "\x01\x00", 2); /* half a u32 */
    expect_bad(&b, MOE_EFORMAT, "value of key 'qwen3moe.block_count' at byte 75", "needs 4 bytes");
    gb_free(&b);

    gb_header(&b, 3, 0, 1);
    gb_u64(&b, 20);
    gb_bytes(&b, "abcdefghij", 10);
    expect_bad(&b, MOE_EFORMAT, "key 0 at byte 24", "string length 20 exceeds the 10 bytes left");
    gb_free(&b);
}

TEST(gguf_rejects_unsupported_version)
{
    struct gb b = {0};
    gb_header(&b, 1, 0, 0);
    expect_bad(&b, MOE_EUNSUPPORTED, "version at byte 4", "v1");
    gb_free(&b);
    gb_header(&b, 4, 0, 0);
    expect_bad(&b, MOE_EUNSUPPORTED, "version at byte 4", "v4");
    gb_free(&b);
    gb_header(&b, 0x03000000, 0, 0);
    expect_bad(&b, MOE_EUNSUPPORTED, "version at byte 4", "big-endian");
    gb_free(&b);
}

TEST(gguf_rejects_huge_counts)
{
    /* Counts whose byte size wraps (n * sizeof overflows to something small) or exceeds the file. */
    const uint64_t bad[] = {UINT64_MAX, (uint64_t)1 << 62, (uint64_t)1 << 60, 1000};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct gb b = {0};
        gb_header(&b, 3, 0, bad[i]);
        gb_kv_u32(&b, "a", 1);
        expect_bad(&b, MOE_EFORMAT, "n_kv at byte 16", "cannot fit");
        gb_free(&b);
        gb_header(&b, 3, bad[i], 0);
        gb_zeros(&b, 100);
        expect_bad(&b, MOE_EFORMAT, "n_tensors at byte 8", "cannot fit");
        gb_free(&b);
    }
}

TEST(gguf_rejects_huge_array_count)
{
    /* 2^62 u32 elements: 2^62 * 4 wraps to 0. */
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "tokenizer.ggml.token_type", GGUF_I32, (uint64_t)1 << 62);
    gb_zeros(&b, 64);
    expect_bad(&b, MOE_EFORMAT, "key 'tokenizer.ggml.token_type' array count at byte 65", "4611686018427387904 elements of i32");
    gb_free(&b);
    /* A string array: each element needs at least its 8-byte length. */
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "tokenizer.ggml.tokens", GGUF_STRING, 9);
    gb_zeros(&b, 64);
    expect_bad(&b, MOE_EFORMAT, "key 'tokenizer.ggml.tokens' array count at byte 61", "9 elements of string");
    gb_free(&b);
}

TEST(gguf_rejects_huge_string_length)
{
    /* length 2^64 - 1: length + 1 wraps to 0, the classic allocation bug. */
    const uint64_t lens[] = {UINT64_MAX, (uint64_t)1 << 63, 5};
    for (size_t i = 0; i < 3; i++) {
        struct gb b = {0};
        gb_header(&b, 3, 0, 1);
        gb_key(&b, "general.name", GGUF_STRING);
        gb_u64(&b, lens[i]);
        gb_bytes(&b, "abcd", 4);
        expect_bad(&b, MOE_EFORMAT, "value of key 'general.name' at byte 48", "string length");
        gb_free(&b);
    }
    /* In a string array element. */
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "t", GGUF_STRING, 2);
    gb_str(&b, "ok");
    gb_u64(&b, UINT64_MAX);
    gb_zeros(&b, 8);
    expect_bad(&b, MOE_EFORMAT, "element 1 of key 't' at byte 59", "string length");
    gb_free(&b);
}

TEST(gguf_rejects_nested_array)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "x", GGUF_ARRAY, 1);
    gb_u32(&b, GGUF_U8);
    gb_u64(&b, 1);
    gb_u8(&b, 0);
    expect_bad(&b, MOE_EFORMAT, "key 'x' at byte 37", "nested arrays");
    gb_free(&b);
}

TEST(gguf_rejects_unknown_value_type)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_key(&b, "x", 13);
    gb_u64(&b, 0);
    expect_bad(&b, MOE_EUNSUPPORTED, "key 'x' at byte 24", "unknown value type 13");
    gb_free(&b);
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "y", 0xffffffffu, 1);
    gb_u64(&b, 0);
    expect_bad(&b, MOE_EUNSUPPORTED, "key 'y' at byte 37", "unknown array element type");
    gb_free(&b);
}

TEST(gguf_rejects_bad_n_dims)
{
    int64_t ne[5] = {32, 1, 1, 1, 1};
    struct gb b = {0};
    /* Header 24 + KV (8+20 key, 4 type, 8+8 value) = 72: the tensor name starts there. */
    one_tensor(&b, "w", 0, ne, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w) n_dims at byte 81", "not in 1..4");
    gb_free(&b);
    one_tensor(&b, "w", 5, ne, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w) n_dims at byte 81", "5 is not in 1..4");
    gb_free(&b);
    /* Four dimensions are fine. */
    one_tensor(&b, "w", 4, ne, MOE_TYPE_F32, 0, 128);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK_EQ(f->tensors[0].n_dims, 4);
    CHECK_EQ(f->tensors[0].nbytes, 128);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_rejects_negative_ne)
{
    int64_t ne[2] = {32, -1};
    struct gb b = {0};
    one_tensor(&b, "w", 2, ne, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w) ne[1] at byte 93", "-1 is negative");
    gb_free(&b);
}

TEST(gguf_accepts_zero_ne)
{
    /* ggml allows empty tensors; they have no data and overlap nothing. */
    int64_t ne[2] = {0, 7};
    struct gb b = {0};
    gb_header(&b, 3, 2, 0);
    gb_tensor(&b, "empty", 2, ne, MOE_TYPE_Q8_0, 0);
    int64_t ne2[1] = {8};
    gb_tensor(&b, "w", 1, ne2, MOE_TYPE_F32, 0);
    gb_pad(&b, 32);
    gb_zeros(&b, 32);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK_EQ(gguf_find_tensor(f, "empty")->nbytes, 0);
    CHECK_EQ(gguf_find_tensor(f, "w")->nbytes, 32);
    gguf_close(f);
    gb_free(&b);
    /* Only an empty tensor, and the file ends right after the tensor table (no padding): the data
     * section would start past the end, which is fine since nothing is in it. */
    gb_header(&b, 3, 1, 0);
    gb_tensor(&b, "empty", 2, ne, MOE_TYPE_F32, 0);
    CHECK(b.n % 32 != 0);
    f = open_mem_ok(&b);
    CHECK(f->data_offset > f->size);
    CHECK(f->tensors[0].data == f->base + f->size);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_rejects_element_count_overflow)
{
    int64_t ne[3] = {(int64_t)1 << 32, (int64_t)1 << 32, 4};
    struct gb b = {0};
    one_tensor(&b, "w", 3, ne, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w) at byte 93", "element count overflows int64");
    gb_free(&b);
    /* Elements fit in int64 but bytes do not: 2^62 f32 values. */
    int64_t ne2[2] = {(int64_t)1 << 31, (int64_t)1 << 31};
    one_tensor(&b, "w", 2, ne2, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w)", "byte size overflows");
    gb_free(&b);
    /* Large but representable: fails on the file size instead. */
    int64_t ne3[2] = {(int64_t)1 << 20, (int64_t)1 << 20};
    one_tensor(&b, "w", 2, ne3, MOE_TYPE_F32, 0, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w)", "ends past the end of the file");
    gb_free(&b);
}

TEST(gguf_rejects_unknown_ggml_type)
{
    const uint32_t bad[] = {4, 5, 31, 40, 1000, 0xffffffffu};
    int64_t ne[1] = {32};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct gb b = {0};
        one_tensor(&b, "w", 1, ne, bad[i], 0, 128);
        char want[64];
        snprintf(want, sizeof want, "unknown ggml type %u", bad[i]);
        expect_bad(&b, MOE_EUNSUPPORTED, "tensor 0 (w) type at byte 93", want);
        gb_free(&b);
    }
}

TEST(gguf_rejects_partial_block_row)
{
    int64_t ne[2] = {48, 2};
    struct gb b = {0};
    one_tensor(&b, "blk.0.attn_q.weight", 2, ne, MOE_TYPE_Q8_0, 0, 256);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (blk.0.attn_q.weight) ne[0] = 48",
               "not a multiple of the q8_0 block size 32");
    gb_free(&b);
    int64_t ne2[1] = {128};
    one_tensor(&b, "k", 1, ne2, MOE_TYPE_Q4_K, 0, 256);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (k) ne[0] = 128", "q4_K block size 256");
    gb_free(&b);
}

TEST(gguf_rejects_misaligned_offset)
{
    int64_t ne[1] = {8};
    struct gb b = {0};
    one_tensor(&b, "w", 1, ne, MOE_TYPE_F32, 16, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w): offset 16", "alignment 32");
    gb_free(&b);
}

TEST(gguf_rejects_overlapping_tensors)
{
    int64_t ne[1] = {16}; /* 64 bytes each */
    struct gb b = {0};
    gb_header(&b, 3, 3, 0);
    gb_tensor(&b, "a", 1, ne, MOE_TYPE_F32, 0);
    gb_tensor(&b, "b", 1, ne, MOE_TYPE_F32, 128);
    gb_tensor(&b, "c", 1, ne, MOE_TYPE_F32, 96); /* [96, 160) overlaps b [128, 192) */
    gb_pad(&b, 32);
    gb_zeros(&b, 256);
    expect_bad(&b, MOE_EFORMAT, "overlaps tensor 2 (c) at [96, 160)", "tensor 1 (b): data [128, 192)");
    gb_free(&b);
    /* The same tensor table without the overlap opens. */
    gb_header(&b, 3, 3, 0);
    gb_tensor(&b, "a", 1, ne, MOE_TYPE_F32, 0);
    gb_tensor(&b, "b", 1, ne, MOE_TYPE_F32, 128);
    gb_tensor(&b, "c", 1, ne, MOE_TYPE_F32, 64);
    gb_pad(&b, 32);
    gb_zeros(&b, 192);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK(gguf_find_tensor(f, "c")->data == f->base + f->data_offset + 64);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_rejects_data_past_end)
{
    int64_t ne[2] = {32, 4}; /* 512 bytes */
    struct gb b = {0};
    one_tensor(&b, "blk.1.ffn_up_exps.weight", 2, ne, MOE_TYPE_F32, 0, 511);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (blk.1.ffn_up_exps.weight): data [0, +512)",
               "ends past the end of the file");
    gb_free(&b);
    /* An offset that would wrap when the size is added. */
    one_tensor(&b, "w", 2, ne, MOE_TYPE_F32, UINT64_MAX - 31, 512);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (w)", "ends past the end of the file");
    gb_free(&b);
}

TEST(gguf_rejects_duplicate_key)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 3);
    gb_kv_u32(&b, "qwen3moe.block_count", 3);
    gb_kv_u32(&b, "other", 1);
    gb_kv_u32(&b, "qwen3moe.block_count", 4);
    expect_bad(&b, MOE_EFORMAT, "duplicate key 'qwen3moe.block_count' at byte 81",
               "first at byte 24");
    gb_free(&b);
}

TEST(gguf_rejects_duplicate_tensor_name)
{
    int64_t ne[1] = {8};
    struct gb b = {0};
    gb_header(&b, 3, 2, 0);
    gb_tensor(&b, "blk.0.attn_norm.weight", 1, ne, MOE_TYPE_F32, 0);
    gb_tensor(&b, "blk.0.attn_norm.weight", 1, ne, MOE_TYPE_F32, 32);
    gb_pad(&b, 32);
    gb_zeros(&b, 64);
    expect_bad(&b, MOE_EFORMAT, "tensor 1 at byte 78: duplicate tensor name 'blk.0.attn_norm.weight'",
               "first is tensor 0");
    gb_free(&b);
}

TEST(gguf_rejects_long_tensor_name)
{
    char name[65];
    memset(name, 'x', 64);
    name[64] = '\0';
    int64_t ne[1] = {8};
    struct gb b = {0};
    one_tensor(&b, name, 1, ne, MOE_TYPE_F32, 0, 32);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 name at byte 72", "length 64 is not below the limit of 64");
    gb_free(&b);
    /* 63 bytes is the longest allowed. */
    name[63] = '\0';
    one_tensor(&b, name, 1, ne, MOE_TYPE_F32, 0, 32);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK(gguf_find_tensor(f, name) != NULL);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_rejects_empty_key_and_name)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 2);
    gb_kv_u32(&b, "a", 1);
    gb_kv_u32(&b, "", 1);
    expect_bad(&b, MOE_EFORMAT, "key 1 at byte 41", "is empty");
    gb_free(&b);
    /* A NUL inside a key would make two different keys equal as C strings. */
    gb_header(&b, 3, 0, 1);
    gb_u64(&b, 3);
    gb_bytes(&b, "a\0b", 3);
    gb_u32(&b, GGUF_U8);
    gb_u8(&b, 1);
    expect_bad(&b, MOE_EFORMAT, "key 0 at byte 24", "NUL");
    gb_free(&b);
    int64_t ne[1] = {8};
    one_tensor(&b, "", 1, ne, MOE_TYPE_F32, 0, 32);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 name at byte 72", "is empty");
    gb_free(&b);
}

TEST(gguf_rejects_bad_bool)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_key(&b, "tokenizer.ggml.add_bos_token", GGUF_BOOL);
    gb_u8(&b, 2);
    expect_bad(&b, MOE_EFORMAT, "key 'tokenizer.ggml.add_bos_token' at byte 64", "bool value 2");
    gb_free(&b);
    gb_header(&b, 3, 0, 1);
    gb_arr(&b, "flags", GGUF_BOOL, 3);
    gb_bytes(&b, "\x00\x01\xff", 3);
    expect_bad(&b, MOE_EFORMAT, "key 'flags' element 2 at byte 55", "bool value 255");
    gb_free(&b);
}

TEST(gguf_rejects_bad_alignment)
{
    const uint32_t bad[] = {0, 3, 48, 0x80000001u};
    for (size_t i = 0; i < 4; i++) {
        struct gb b = {0};
        gb_header(&b, 3, 0, 1);
        gb_kv_u32(&b, "general.alignment", bad[i]);
        expect_bad(&b, MOE_EFORMAT, "key 'general.alignment' at byte 24", "not a nonzero power of two");
        gb_free(&b);
    }
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_key(&b, "general.alignment", GGUF_U64);
    gb_u64(&b, 32);
    expect_bad(&b, MOE_EFORMAT, "key 'general.alignment' at byte 24", "type u64, must be u32");
    gb_free(&b);
}

TEST(gguf_custom_alignment)
{
    /* With alignment 64 the data section starts at the next multiple of 64, and offsets must be
     * multiples of 64. */
    int64_t ne[1] = {8};
    struct gb b = {0};
    gb_header(&b, 3, 2, 1);
    gb_kv_u32(&b, "general.alignment", 64);
    gb_tensor(&b, "a", 1, ne, MOE_TYPE_F32, 0);
    gb_tensor(&b, "b", 1, ne, MOE_TYPE_F32, 64);
    size_t info_end = b.n;
    gb_pad(&b, 64);
    gb_zeros(&b, 64);
    gb_f32(&b, 1.5f);
    gb_zeros(&b, 28);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK_EQ(f->alignment, 64);
    CHECK_EQ(f->data_offset, (info_end + 63) / 64 * 64);
    float v;
    memcpy(&v, gguf_find_tensor(f, "b")->data, 4);
    CHECK_NEAR(v, 1.5, 0);
    gguf_close(f);
    gb_free(&b);

    gb_header(&b, 3, 1, 1);
    gb_kv_u32(&b, "general.alignment", 64);
    gb_tensor(&b, "a", 1, ne, MOE_TYPE_F32, 32);
    gb_pad(&b, 64);
    gb_zeros(&b, 128);
    expect_bad(&b, MOE_EFORMAT, "tensor 0 (a): offset 32", "alignment 64");
    gb_free(&b);
}

/* Every KV type, read back through every getter, in a v2 file (v2 has the same layout as v3). */
TEST(gguf_v2_all_types_and_getters)
{
    struct gb b = {0};
    gb_header(&b, 2, 0, GB_N_ALL_SCALARS + 5);
    gb_kv_all_scalars(&b);
    gb_arr(&b, "af32", GGUF_F32, 3), gb_f32(&b, 1), gb_f32(&b, -2), gb_f32(&b, 3.5f);
    gb_arr(&b, "ai16", GGUF_I16, 2), gb_bytes(&b, "\xfe\xff\x07\x00", 4);
    gb_arr(&b, "astr", GGUF_STRING, 3), gb_str(&b, "a"), gb_str(&b, ""), gb_str(&b, "ccc");
    gb_arr(&b, "aempty", GGUF_U64, 0);
    gb_key(&b, "u64small", GGUF_U64), gb_u64(&b, 42);
    struct gguf_file *f = open_mem_ok(&b);
    CHECK_EQ(f->version, 2);
    char err[256];
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f32;
    bool bl;
    struct gguf_str s;
    const struct gguf_kv *kv;

    CHECK_EQ(gguf_get_u32(f, "u8", &u32, err, sizeof err), 0);
    CHECK_EQ(u32, 200);
    CHECK_EQ(gguf_get_u32(f, "u16", &u32, err, sizeof err), 0);
    CHECK_EQ(u32, 65535);
    CHECK_EQ(gguf_get_u32(f, "u32", &u32, err, sizeof err), 0);
    CHECK_EQ(u32, 4000000000u);
    CHECK_EQ(gguf_get_u32(f, "u64small", &u32, err, sizeof err), 0);
    CHECK_EQ(u32, 42);
    CHECK_EQ(gguf_get_u32(f, "i32", &u32, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "'i32'") && strstr(err, "-5 does not fit u32"));
    CHECK_EQ(gguf_get_u32(f, "u64", &u32, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_get_u32(f, "str", &u32, err, sizeof err), MOE_ETYPE);
    CHECK(strstr(err, "expected an integer, found string"));
    CHECK_EQ(gguf_get_u32(f, "bool", &u32, err, sizeof err), MOE_ETYPE);
    CHECK_EQ(gguf_get_u32(f, "f32", &u32, err, sizeof err), MOE_ETYPE);
    CHECK_EQ(gguf_get_u32(f, "nope", &u32, err, sizeof err), MOE_ENOTFOUND);
    CHECK(strstr(err, "'nope' not found"));

    CHECK_EQ(gguf_get_u64(f, "u64", &u64, err, sizeof err), 0);
    CHECK(u64 == UINT64_MAX);
    CHECK_EQ(gguf_get_u64(f, "i8", &u64, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_get_i64(f, "i8", &i64, err, sizeof err), 0);
    CHECK_EQ(i64, -128);
    CHECK_EQ(gguf_get_i64(f, "i16", &i64, err, sizeof err), 0);
    CHECK_EQ(i64, -32768);
    CHECK_EQ(gguf_get_i64(f, "i64", &i64, err, sizeof err), 0);
    CHECK(i64 == INT64_MIN);
    CHECK_EQ(gguf_get_i64(f, "u32", &i64, err, sizeof err), 0);
    CHECK_EQ(i64, 4000000000LL);
    CHECK_EQ(gguf_get_i64(f, "u64", &i64, err, sizeof err), MOE_ERANGE);

    CHECK_EQ(gguf_get_f32(f, "f32", &f32, err, sizeof err), 0);
    CHECK_NEAR(f32, 0.25, 0);
    CHECK_EQ(gguf_get_f32(f, "f64", &f32, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_get_f32(f, "u8", &f32, err, sizeof err), MOE_ETYPE);
    CHECK_EQ(gguf_get_bool(f, "bool", &bl, err, sizeof err), 0);
    CHECK(bl);
    CHECK_EQ(gguf_get_bool(f, "u8", &bl, err, sizeof err), MOE_ETYPE);
    CHECK_EQ(gguf_get_str(f, "str", &s, err, sizeof err), 0);
    CHECK(s.len == 5 && !memcmp(s.p, "hello", 5));
    CHECK_EQ(gguf_get_str(f, "u8", &s, err, sizeof err), MOE_ETYPE);

    CHECK_EQ(gguf_get_arr(f, "af32", GGUF_F32, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 3);
    CHECK_NEAR(gguf_arr_f64(kv, 1), -2, 0);
    CHECK_NEAR(gguf_arr_f64(kv, 2), 3.5, 0);
    CHECK(kv->v.arr.strs == NULL);
    CHECK_EQ(gguf_get_arr(f, "af32", GGUF_I32, &kv, err, sizeof err), MOE_ETYPE);
    CHECK(strstr(err, "expected array of i32, found array of f32"));
    CHECK_EQ(gguf_get_arr(f, "u8", GGUF_U8, &kv, err, sizeof err), MOE_ETYPE);
    CHECK_EQ(gguf_get_arr(f, "ai16", GGUF_I16, &kv, err, sizeof err), 0);
    CHECK_EQ(gguf_arr_i64(kv, 0), -2);
    CHECK_EQ(gguf_arr_i64(kv, 1), 7);
    CHECK_NEAR(gguf_arr_f64(kv, 0), -2, 0);
    CHECK_EQ(gguf_get_arr(f, "astr", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK(kv->v.arr.strs[1].len == 0 && kv->v.arr.strs[2].len == 3 &&
          !memcmp(kv->v.arr.strs[2].p, "ccc", 3));
    CHECK_EQ(gguf_get_arr(f, "aempty", GGUF_U64, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 0);

    CHECK_STREQ(gguf_vtype_name(GGUF_STRING), "string");
    CHECK_STREQ(gguf_vtype_name(GGUF_F64), "f64");
    CHECK_STREQ(gguf_vtype_name(13), "?");
    CHECK_STREQ(f->kv[0].key, "u8");
    CHECK_EQ(f->kv[0].offset, 24);
    gguf_close(f);
    gb_free(&b);
}

TEST(gguf_fingerprint_tracks_metadata)
{
    /* Same bytes give the same fingerprint; one changed value, tensor type or offset changes it;
     * tensor data does not count; the version does not count. */
    uint64_t fp[5];
    for (int k = 0; k < 5; k++) {
        struct gb b = {0};
        int64_t ne[1] = {8};
        gb_header(&b, k == 4 ? 2 : 3, 1, 1);
        gb_kv_u32(&b, "x", k == 1 ? 2 : 1);
        gb_tensor(&b, "w", 1, ne, k == 2 ? MOE_TYPE_F16 : MOE_TYPE_F32, 0);
        gb_pad(&b, 32);
        gb_zeros(&b, 32);
        if (k == 3)
            b.p[b.n - 1] = 9; /* tensor data only */
        struct gguf_file *f = open_mem_ok(&b);
        fp[k] = gguf_fingerprint(f);
        gguf_close(f);
        gb_free(&b);
    }
    CHECK(fp[0] != fp[1]);
    CHECK(fp[0] != fp[2]);
    CHECK(fp[0] == fp[3]);
    CHECK(fp[0] == fp[4]);
}

TEST(gguf_open_errors)
{
    char err[512];
    struct gguf_file *f = NULL;
    CHECK_EQ(gguf_open(&f, "/nonexistent/x.gguf", err, sizeof err), -2);
    CHECK(strstr(err, "/nonexistent/x.gguf"));
    CHECK_EQ(gguf_open(&f, "tests", err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "not a regular file"));
    /* A parse error through gguf_open names the file. */
    char path[512];
    snprintf(path, sizeof path, "%s/bad.gguf", moe_test_tmpdir());
    moe_test_write_file(path, "GGUF\x03\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff\0\0\0\0\0\0\0\0",
                        24);
    CHECK_EQ(gguf_open(&f, path, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, path) && strstr(err, "n_tensors at byte 8"));
    CHECK(f == NULL);
}

TEST(gguf_many_names_lookup)
{
    /* 5000 tensors and 5000 keys: every one found through the hash tables. */
    enum { N = 5000 };
    struct gb b = {0};
    gb_header(&b, 3, N, N);
    char name[64];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "k.%d", i);
        gb_kv_u32(&b, name, (uint32_t)i * 3);
    }
    int64_t ne[1] = {8};
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "blk.%d.w", i);
        gb_tensor(&b, name, 1, ne, MOE_TYPE_F32, (uint64_t)i * 32);
    }
    gb_pad(&b, 32);
    gb_zeros(&b, 32 * N);
    struct gguf_file *f = open_mem_ok(&b);
    char err[128];
    for (int i = 0; i < N; i++) {
        uint32_t v;
        snprintf(name, sizeof name, "k.%d", i);
        CHECK_EQ(gguf_get_u32(f, name, &v, err, sizeof err), 0);
        CHECK_EQ(v, (uint32_t)i * 3);
        snprintf(name, sizeof name, "blk.%d.w", i);
        const struct gguf_tensor *t = gguf_find_tensor(f, name);
        CHECK(t && t->offset == (uint64_t)i * 32);
    }
    CHECK(gguf_find_tensor(f, "blk.5000.w") == NULL);
    gguf_close(f);
    gb_free(&b);
}

/* Tests of the GGUF writer (store/gguf_write.h) and of `moectl mkmodel`: files our reader and
 * model loader accept, block data with the intended statistics, byte-for-byte determinism
 * (seed, thread count), the golden tiny vocabulary, and skewed routing. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/gguf_write.h"
#include "store/model.h"
#include "store/quant.h"
#include "tests/harness.h"

#define GOLDEN_DIR "tests/golden/models/"

/* ---- the writer ----------------------------------------------------------------------------- */

/* Builds a file in memory: metadata from the writer, tensor data copied to its offsets. */
static uint8_t *writer_to_mem(struct gguf_writer *w, void *const *data, size_t *size)
{
    char err[256];
    CHECK_MSG(gguf_writer_layout(w, err, sizeof err) == 0, "layout: %s", err);
    *size = (size_t)gguf_writer_file_size(w);
    uint8_t *buf = calloc(1, *size);
    CHECK(buf);
    CHECK_EQ(gguf_writer_meta(w, buf, *size), 0);
    for (uint64_t i = 0; i < gguf_writer_n_tensors(w); i++) {
        struct gguf_writer_tensor t;
        CHECK_EQ(gguf_writer_tensor(w, i, &t), 0);
        CHECK(t.file_offset + t.nbytes <= *size);
        memcpy(buf + t.file_offset, data[i], (size_t)t.nbytes);
    }
    return buf;
}

TEST(gguf_write_roundtrip_all_kv_types)
{
    struct gguf_writer *w;
    char err[256];
    CHECK_EQ(gguf_writer_new(&w), 0);
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    int32_t i32 = -2000000000;
    double f64 = -1.25e300;
    int64_t i64 = -(1ll << 62);
    CHECK_EQ(gguf_writer_add_str(w, "general.architecture", "qwen3moe", 8, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.u8", GGUF_U8, &u8, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.i8", GGUF_I8, &i8, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.u16", GGUF_U16, &u16, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.i16", GGUF_I16, &i16, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_u32(w, "k.u32", 4000000000u, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_i32(w, "k.i32", i32, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "k.f32", 0.15625f, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_bool(w, "k.bool", true, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_u64(w, "k.u64", 0xfedcba9876543210ull, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.i64", GGUF_I64, &i64, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_scalar(w, "k.f64", GGUF_F64, &f64, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_str(w, "k.empty", "", 0, err, sizeof err), 0);
    int32_t arr[5] = {1, -2, 3, -4, 5};
    CHECK_EQ(gguf_writer_add_arr(w, "k.arr_i32", GGUF_I32, arr, 5, err, sizeof err), 0);
    float farr[3] = {0.5f, -1.5f, 2.5f};
    CHECK_EQ(gguf_writer_add_arr(w, "k.arr_f32", GGUF_F32, farr, 3, err, sizeof err), 0);
    struct gguf_str strs[3] = {{"a", 1}, {"", 0}, {"h\xc3\xa9llo", 6}};
    CHECK_EQ(gguf_writer_add_arr_str(w, "k.arr_str", strs, 3, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_arr(w, "k.arr_empty", GGUF_U8, NULL, 0, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_set_alignment(w, 64, err, sizeof err), 0);

    /* Tensors of odd sizes so that padding between them matters. */
    int64_t ne_a[2] = {32, 3}, ne_b[1] = {5}, ne_c[3] = {256, 2, 2};
    uint64_t ia, ib, ic;
    CHECK_EQ(gguf_writer_add_tensor(w, "a", 2, ne_a, MOE_TYPE_Q8_0, &ia, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w, "b", 1, ne_b, MOE_TYPE_F32, &ib, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w, "c", 3, ne_c, MOE_TYPE_Q4_K, &ic, err, sizeof err), 0);
    CHECK_EQ(ia, 0);
    CHECK_EQ(ic, 2);
    uint8_t da[3 * 34], db[20], dc[4 * 144];
    for (size_t i = 0; i < sizeof da; i++)
        da[i] = (uint8_t)(i * 7 + 1);
    for (size_t i = 0; i < sizeof db; i++)
        db[i] = (uint8_t)(i + 100);
    for (size_t i = 0; i < sizeof dc; i++)
        dc[i] = (uint8_t)(i * 13);
    void *data[3] = {da, db, dc};
    size_t size;
    uint8_t *buf = writer_to_mem(w, data, &size);

    struct gguf_file *f;
    CHECK_MSG(gguf_open_mem(&f, buf, size, err, sizeof err) == 0, "reader: %s", err);
    CHECK_EQ(f->version, 3);
    CHECK_EQ(f->alignment, 64);
    CHECK_EQ(f->data_offset % 64, 0);
    CHECK_EQ(f->n_kv, 18);
    CHECK_STREQ(f->kv[0].key, "general.architecture");
    uint64_t u;
    int64_t s;
    float fl;
    bool b;
    struct gguf_str str;
    CHECK_EQ(gguf_get_u64(f, "k.u8", &u, err, sizeof err), 0);
    CHECK_EQ(u, 200);
    CHECK_EQ(gguf_get_i64(f, "k.i8", &s, err, sizeof err), 0);
    CHECK_EQ(s, -100);
    CHECK_EQ(gguf_get_u64(f, "k.u16", &u, err, sizeof err), 0);
    CHECK_EQ(u, 60000);
    CHECK_EQ(gguf_get_i64(f, "k.i16", &s, err, sizeof err), 0);
    CHECK_EQ(s, -30000);
    CHECK_EQ(gguf_get_u64(f, "k.u32", &u, err, sizeof err), 0);
    CHECK_EQ(u, 4000000000u);
    CHECK_EQ(gguf_get_i64(f, "k.i32", &s, err, sizeof err), 0);
    CHECK_EQ(s, i32);
    CHECK_EQ(gguf_get_f32(f, "k.f32", &fl, err, sizeof err), 0);
    CHECK(fl == 0.15625f);
    CHECK_EQ(gguf_get_bool(f, "k.bool", &b, err, sizeof err), 0);
    CHECK(b);
    CHECK_EQ(gguf_get_u64(f, "k.u64", &u, err, sizeof err), 0);
    CHECK(u == 0xfedcba9876543210ull);
    CHECK_EQ(gguf_get_i64(f, "k.i64", &s, err, sizeof err), 0);
    CHECK(s == i64);
    const struct gguf_kv *kv = gguf_find_kv(f, "k.f64");
    CHECK(kv && kv->type == GGUF_F64 && kv->v.f64 == f64);
    CHECK_EQ(gguf_get_str(f, "k.empty", &str, err, sizeof err), 0);
    CHECK_EQ(str.len, 0);
    CHECK_EQ(gguf_get_str(f, "general.architecture", &str, err, sizeof err), 0);
    CHECK(str.len == 8 && !memcmp(str.p, "qwen3moe", 8));
    CHECK_EQ(gguf_get_arr(f, "k.arr_i32", GGUF_I32, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 5);
    for (int i = 0; i < 5; i++)
        CHECK_EQ(gguf_arr_i64(kv, (uint64_t)i), arr[i]);
    CHECK_EQ(gguf_get_arr(f, "k.arr_f32", GGUF_F32, &kv, err, sizeof err), 0);
    CHECK(gguf_arr_f64(kv, 1) == -1.5);
    CHECK_EQ(gguf_get_arr(f, "k.arr_str", GGUF_STRING, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 3);
    CHECK(kv->v.arr.strs[0].len == 1 && kv->v.arr.strs[0].p[0] == 'a');
    CHECK_EQ(kv->v.arr.strs[1].len, 0);
    CHECK(kv->v.arr.strs[2].len == 6 && !memcmp(kv->v.arr.strs[2].p, "h\xc3\xa9llo", 6));
    CHECK_EQ(gguf_get_arr(f, "k.arr_empty", GGUF_U8, &kv, err, sizeof err), 0);
    CHECK_EQ(kv->v.arr.n, 0);
    CHECK_EQ(gguf_get_u64(f, "general.alignment", &u, err, sizeof err), 0);
    CHECK_EQ(u, 64);

    CHECK_EQ(f->n_tensors, 3);
    const struct gguf_tensor *t = gguf_find_tensor(f, "c");
    CHECK(t);
    CHECK_EQ(t->n_dims, 3);
    CHECK(t->ne[0] == 256 && t->ne[1] == 2 && t->ne[2] == 2 && t->ne[3] == 1);
    CHECK_EQ(t->type, MOE_TYPE_Q4_K);
    CHECK_EQ(t->offset % 64, 0);
    CHECK_EQ(t->nbytes, sizeof dc);
    CHECK(!memcmp(t->data, dc, sizeof dc));
    t = gguf_find_tensor(f, "b");
    CHECK(t && t->nbytes == sizeof db && !memcmp(t->data, db, sizeof db));
    t = gguf_find_tensor(f, "a");
    CHECK(t && t->offset == 0 && !memcmp(t->data, da, sizeof da));

    /* Copying every KV through the writer reproduces the same metadata bytes. */
    struct gguf_writer *w2;
    CHECK_EQ(gguf_writer_new(&w2), 0);
    for (uint64_t i = 0; i < f->n_kv; i++)
        CHECK_MSG(gguf_writer_copy_kv(w2, &f->kv[i], NULL, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(gguf_writer_set_alignment(w2, 64, err, sizeof err), 0); /* updates, not adds */
    CHECK_EQ(gguf_writer_add_tensor(w2, "a", 2, ne_a, MOE_TYPE_Q8_0, NULL, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w2, "b", 1, ne_b, MOE_TYPE_F32, NULL, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w2, "c", 3, ne_c, MOE_TYPE_Q4_K, NULL, err, sizeof err), 0);
    size_t size2;
    uint8_t *buf2 = writer_to_mem(w2, data, &size2);
    CHECK_EQ(size2, size);
    CHECK(!memcmp(buf, buf2, size));
    gguf_close(f);
    gguf_writer_free(w2);
    gguf_writer_free(w);
    free(buf2);
    free(buf);
}

TEST(gguf_write_rejects_bad_declarations)
{
    struct gguf_writer *w;
    char err[256];
    CHECK_EQ(gguf_writer_new(&w), 0);
    CHECK_EQ(gguf_writer_add_u32(w, "x", 1, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_u32(w, "x", 2, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "duplicate"));
    CHECK_EQ(gguf_writer_add_str(w, "", "v", 1, err, sizeof err), MOE_EFORMAT);
    CHECK_EQ(gguf_writer_add_scalar(w, "y", GGUF_STRING, "", err, sizeof err), MOE_EUNSUPPORTED);
    uint8_t two = 2;
    CHECK_EQ(gguf_writer_add_scalar(w, "y", GGUF_BOOL, &two, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_writer_add_arr(w, "y", GGUF_ARRAY, NULL, 0, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK_EQ(gguf_writer_set_alignment(w, 48, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_writer_set_alignment(w, 0, err, sizeof err), MOE_ERANGE);
    CHECK(!gguf_writer_has_kv(w, "general.alignment"));

    int64_t ne[2] = {32, 4};
    CHECK_EQ(gguf_writer_add_tensor(w, "t", 2, ne, MOE_TYPE_F16, NULL, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w, "t", 2, ne, MOE_TYPE_F16, NULL, err, sizeof err), MOE_EFORMAT);
    char longname[80];
    memset(longname, 'n', sizeof longname);
    longname[64] = 0; /* 64 bytes + NUL does not fit GGUF_NAME_MAX */
    CHECK_EQ(gguf_writer_add_tensor(w, longname, 2, ne, MOE_TYPE_F16, NULL, err, sizeof err),
             MOE_EFORMAT);
    longname[63] = 0;
    CHECK_EQ(gguf_writer_add_tensor(w, longname, 2, ne, MOE_TYPE_F16, NULL, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_tensor(w, "q", 2, ne, MOE_TYPE_Q4_K, NULL, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "block size"));
    CHECK_EQ(gguf_writer_add_tensor(w, "q", 2, ne, 4, NULL, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK_EQ(gguf_writer_add_tensor(w, "q", 5, ne, MOE_TYPE_F32, NULL, err, sizeof err), MOE_EFORMAT);
    CHECK_EQ(gguf_writer_add_tensor(w, "q", 0, ne, MOE_TYPE_F32, NULL, err, sizeof err), MOE_EFORMAT);
    int64_t bad[2] = {32, 0};
    CHECK_EQ(gguf_writer_add_tensor(w, "q", 2, bad, MOE_TYPE_F32, NULL, err, sizeof err), MOE_EFORMAT);

    /* Wrong order of steps is an error, not a crash. */
    CHECK_EQ(gguf_writer_pwrite(w, 0, 0, "x", 1, err, sizeof err), MOE_EINTERNAL);
    CHECK_EQ(gguf_writer_layout(w, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_u32(w, "late", 1, err, sizeof err), MOE_EINTERNAL);
    CHECK_EQ(gguf_writer_add_tensor(w, "late", 2, ne, MOE_TYPE_F16, NULL, err, sizeof err),
             MOE_EINTERNAL);
    struct gguf_writer_tensor t;
    CHECK_EQ(gguf_writer_tensor(w, 2, &t), MOE_ERANGE);
    CHECK_EQ(gguf_writer_tensor(w, 1, &t), 0);
    CHECK_EQ(t.offset, 256); /* 32*4*2 = 256 bytes, already aligned */

    char path[512];
    snprintf(path, sizeof path, "%s/no/such/dir/x.gguf", moe_test_tmpdir());
    CHECK(gguf_writer_create(w, path, err, sizeof err) < 0);
    CHECK(strstr(err, path));
    snprintf(path, sizeof path, "%s/x.gguf", moe_test_tmpdir());
    CHECK_EQ(gguf_writer_create(w, path, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_pwrite(w, 0, 250, "0123456789", 10, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_writer_pwrite(w, 2, 0, "0", 1, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(gguf_writer_pwrite(w, 0, 246, "0123456789", 10, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_finish(w, true, err, sizeof err), 0);
    gguf_writer_free(w);

    struct gguf_file *f;
    CHECK_MSG(gguf_open(&f, path, err, sizeof err) == 0, "%s", err);
    const struct gguf_tensor *tt = gguf_find_tensor(f, "t");
    CHECK(tt && !memcmp((const uint8_t *)tt->data + 246, "0123456789", 10));
    CHECK_EQ(((const uint8_t *)tt->data)[0], 0); /* never written: the sized file reads zeros */
    gguf_close(f);
}

struct pw_arg {
    struct gguf_writer *w;
    int id, n_threads;
};

/* Thread `id` writes the rows r with r % n_threads == id of every tensor, one small pwrite each. */
static void *pw_thread(void *p)
{
    struct pw_arg *a = p;
    char err[128];
    uint8_t row[64];
    for (uint64_t ti = 0; ti < 4; ti++)
        for (int r = a->id; r < 256; r += a->n_threads) {
            for (int i = 0; i < 64; i++)
                row[i] = (uint8_t)(ti * 31 + (uint64_t)r * 7 + (uint64_t)i);
            if (gguf_writer_pwrite(a->w, ti, (uint64_t)r * 64, row, 64, err, sizeof err))
                return (void *)1;
        }
    return NULL;
}

TEST(gguf_write_parallel_pwrite)
{
    struct gguf_writer *w;
    char err[256], path[512];
    CHECK_EQ(gguf_writer_new(&w), 0);
    for (int i = 0; i < 4; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%d", i);
        int64_t ne[2] = {32, 256}; /* F16: 64-byte rows */
        CHECK_EQ(gguf_writer_add_tensor(w, name, 2, ne, MOE_TYPE_F16, NULL, err, sizeof err), 0);
    }
    CHECK_EQ(gguf_writer_layout(w, err, sizeof err), 0);
    snprintf(path, sizeof path, "%s/p.gguf", moe_test_tmpdir());
    CHECK_EQ(gguf_writer_create(w, path, err, sizeof err), 0);
    enum { NT = 4 };
    pthread_t th[NT];
    struct pw_arg args[NT];
    for (int i = 0; i < NT; i++) {
        args[i] = (struct pw_arg){w, i, NT};
        CHECK_EQ(pthread_create(&th[i], NULL, pw_thread, &args[i]), 0);
    }
    for (int i = 0; i < NT; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        CHECK(ret == NULL);
    }
    CHECK_EQ(gguf_writer_finish(w, false, err, sizeof err), 0);
    struct stat st;
    CHECK_EQ(stat(path, &st), 0);
    CHECK_EQ((uint64_t)st.st_size, gguf_writer_file_size(w));
    gguf_writer_free(w);

    struct gguf_file *f;
    CHECK_MSG(gguf_open(&f, path, err, sizeof err) == 0, "%s", err);
    for (uint64_t ti = 0; ti < 4; ti++) {
        const uint8_t *d = f->tensors[ti].data;
        for (uint64_t r = 0; r < 256; r++)
            for (int i = 0; i < 64; i++)
                CHECK_EQ(d[r * 64 + (uint64_t)i], (uint8_t)(ti * 31 + r * 7 + (uint64_t)i));
    }
    gguf_close(f);
}

/* ---- moectl mkmodel ------------------------------------------------------------------------- */

/* Runs `moectl mkmodel ARGS -o tmpdir/NAME` (ARGS split at spaces), returns the exit status and
 * fills path. A moectl that could not run or was killed fails the test. */
static int mkmodel(char *path, size_t pathlen, const char *name, const char *args)
{
    char words[1024];
    char *argv[32], *save = NULL;
    int n = 0;
    snprintf(path, pathlen, "%s/%s", moe_test_tmpdir(), name);
    CHECK(strlen(args) < sizeof words);
    snprintf(words, sizeof words, "%s", args);
    argv[n++] = (char *)moe_test_bin("moectl");
    argv[n++] = "mkmodel";
    argv[n++] = "--quiet";
    for (char *w = strtok_r(words, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        CHECK(n < 29);
        argv[n++] = w;
    }
    argv[n++] = "-o";
    argv[n++] = path;
    argv[n] = NULL;
    int st = moe_test_run(argv, NULL, NULL);
    CHECK_MSG(st >= 0 && st < 128, "could not run: moectl mkmodel %s (status %d)", args, st);
    return st;
}

static void open_model(const char *path, struct gguf_file **f, struct moe_model *m)
{
    char err[512];
    CHECK_MSG(gguf_open(f, path, err, sizeof err) == 0, "gguf_open %s: %s", path, err);
    memset(m, 0, sizeof *m);
    CHECK_MSG(moe_model_from_gguf(m, *f, err, sizeof err) == 0, "moe_model_from_gguf %s: %s",
              path, err);
}

/* Every tensor of `a` has the same name, shape and type in `b`, and the counts agree. */
static void check_same_tensor_table(const struct gguf_file *a, const struct gguf_file *b)
{
    CHECK_EQ(a->n_tensors, b->n_tensors);
    for (uint64_t i = 0; i < a->n_tensors; i++) {
        const struct gguf_tensor *t = &a->tensors[i], *u = gguf_find_tensor(b, t->name);
        CHECK_MSG(u, "%s missing", t->name);
        CHECK_MSG(t->type == u->type, "%s: type %s vs %s", t->name, moe_type_get(t->type)->name,
                  moe_type_get(u->type)->name);
        CHECK_EQ(t->n_dims, u->n_dims);
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            CHECK_EQ(t->ne[d], u->ne[d]);
    }
}

static void check_tiny_quant(const char *quant, const char *golden, uint32_t file_type)
{
    char path[512], args[128], err[256];
    snprintf(args, sizeof args, "--preset tiny --quant %s --threads 2", quant);
    CHECK_EQ(mkmodel(path, sizeof path, "m.gguf", args), 0);
    struct gguf_file *f, *g;
    struct moe_model m;
    open_model(path, &f, &m);
    CHECK_EQ(m.arch, MOE_ARCH_QWEN3MOE);
    CHECK_EQ(m.hp.n_layer, 3);
    CHECK_EQ(m.hp.n_embd, 256);
    CHECK_EQ(m.hp.n_head, 4);
    CHECK_EQ(m.hp.n_head_kv, 2);
    CHECK_EQ(m.hp.head_dim, 64);
    CHECK_EQ(m.hp.n_expert, 16);
    CHECK_EQ(m.hp.n_expert_used, 4);
    CHECK_EQ(m.hp.expert_ff, 128);
    CHECK_EQ(m.hp.n_vocab, 4160);
    CHECK_NEAR(m.hp.rope_base, 1e6, 1);
    CHECK_NEAR(m.hp.rms_eps, 1e-6, 1e-12);
    uint32_t ft;
    CHECK_EQ(gguf_get_u32(f, "general.file_type", &ft, err, sizeof err), 0);
    CHECK_EQ(ft, file_type);
    CHECK_EQ(f->alignment, 32);
    /* Same shapes and the same per-tensor block types as llama-quantize gave the golden file. */
    CHECK_MSG(gguf_open(&g, golden, err, sizeof err) == 0, "%s", err);
    check_same_tensor_table(f, g);
    gguf_close(g);
    moe_model_free(&m);
    gguf_close(f);
}

TEST(mkmodel_tiny_f16_loads)
{
    check_tiny_quant("f16", GOLDEN_DIR "tiny-qwen3moe-F16.gguf", 1);
}

TEST(mkmodel_tiny_q8_0_loads)
{
    check_tiny_quant("q8_0", GOLDEN_DIR "tiny-qwen3moe-Q8_0.gguf", 7);
}

TEST(mkmodel_tiny_q4_k_m_loads)
{
    check_tiny_quant("q4_k_m", GOLDEN_DIR "tiny-qwen3moe-Q4_K_M.gguf", 15);
}

TEST(mkmodel_deterministic_seed_and_threads)
{
    char a[512], b[512], c[512], d[512];
    CHECK_EQ(mkmodel(a, sizeof a, "a.gguf", "--preset tiny --quant q4_k_m --seed 7 --threads 1"), 0);
    CHECK_EQ(mkmodel(b, sizeof b, "b.gguf", "--preset tiny --quant q4_k_m --seed 7 --threads 3"), 0);
    CHECK_EQ(mkmodel(c, sizeof c, "c.gguf", "--preset tiny --quant q4_k_m --seed 8 --threads 2"), 0);
    CHECK_EQ(mkmodel(d, sizeof d, "d.gguf", "--preset tiny --quant q4_k_m --seed 7 --threads 2"), 0);
    size_t na, nb, nc, nd;
    uint8_t *pa = (uint8_t *)moe_test_read_file_or_fail(a, &na);
    uint8_t *pb = (uint8_t *)moe_test_read_file_or_fail(b, &nb);
    uint8_t *pc = (uint8_t *)moe_test_read_file_or_fail(c, &nc);
    uint8_t *pd = (uint8_t *)moe_test_read_file_or_fail(d, &nd);
    CHECK_EQ(na, nb);
    CHECK(!memcmp(pa, pb, na)); /* thread count does not change the bytes */
    CHECK_EQ(na, nd);
    CHECK(!memcmp(pa, pd, na)); /* nor does running again */
    /* Another seed: same layout, different weights in every weight tensor. */
    CHECK_EQ(na, nc);
    struct gguf_file *fa, *fc;
    char err[256];
    CHECK_EQ(gguf_open_mem(&fa, pa, na, err, sizeof err), 0);
    CHECK_EQ(gguf_open_mem(&fc, pc, nc, err, sizeof err), 0);
    CHECK_EQ(fa->n_tensors, fc->n_tensors);
    for (uint64_t i = 0; i < fa->n_tensors; i++) {
        const struct gguf_tensor *ta = &fa->tensors[i], *tc = &fc->tensors[i];
        CHECK_STREQ(ta->name, tc->name);
        CHECK_EQ(ta->nbytes, tc->nbytes);
        CHECK_MSG(memcmp(ta->data, tc->data, (size_t)ta->nbytes) != 0, "%s equal across seeds",
                  ta->name);
    }
    gguf_close(fa);
    gguf_close(fc);
    free(pa);
    free(pb);
    free(pc);
    free(pd);
}

static void check_same_kv(const struct gguf_file *a, const struct gguf_file *b, const char *key)
{
    const struct gguf_kv *x = gguf_find_kv(a, key), *y = gguf_find_kv(b, key);
    CHECK_MSG(x && y, "%s missing", key);
    CHECK_MSG(x->type == y->type, "%s: type differs", key);
    switch (x->type) {
    case GGUF_STRING:
        CHECK_MSG(x->v.str.len == y->v.str.len && !memcmp(x->v.str.p, y->v.str.p, x->v.str.len),
                  "%s differs", key);
        break;
    case GGUF_ARRAY:
        CHECK_MSG(x->v.arr.type == y->v.arr.type && x->v.arr.n == y->v.arr.n,
                  "%s: %llu vs %llu elements", key, (unsigned long long)x->v.arr.n,
                  (unsigned long long)y->v.arr.n);
        for (uint64_t i = 0; i < x->v.arr.n; i++) {
            if (x->v.arr.type == GGUF_STRING) {
                const struct gguf_str *s = &x->v.arr.strs[i], *t = &y->v.arr.strs[i];
                CHECK_MSG(s->len == t->len && !memcmp(s->p, t->p, s->len), "%s[%llu] differs",
                          key, (unsigned long long)i);
            } else {
                CHECK_MSG(gguf_arr_i64(x, i) == gguf_arr_i64(y, i), "%s[%llu] differs", key,
                          (unsigned long long)i);
            }
        }
        break;
    default:
        CHECK_MSG(x->v.u64 == y->v.u64, "%s differs", key);
    }
}

TEST(mkmodel_tiny_vocab_equals_golden)
{
    char path[512], err[256];
    CHECK_EQ(mkmodel(path, sizeof path, "v.gguf", "--preset tiny --quant q8_0"), 0);
    struct gguf_file *f, *g;
    CHECK_MSG(gguf_open(&f, path, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(gguf_open(&g, GOLDEN_DIR "tiny-qwen3moe-F16.gguf", err, sizeof err) == 0, "%s", err);
    /* Every tokenizer key of the golden file, and no others. */
    int n_tok = 0;
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (!strncmp(g->kv[i].key, "tokenizer.", 10)) {
            check_same_kv(f, g, g->kv[i].key);
            n_tok++;
        }
    CHECK_EQ(n_tok, 10);
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (!strncmp(f->kv[i].key, "tokenizer.", 10))
            CHECK_MSG(gguf_find_kv(g, f->kv[i].key), "extra key %s", f->kv[i].key);
    /* And the model-level keys the golden file has. */
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (!strncmp(g->kv[i].key, "qwen3moe.", 9) || !strcmp(g->kv[i].key, "general.architecture"))
            check_same_kv(f, g, g->kv[i].key);
    gguf_close(g);
    gguf_close(f);
}

/* Dequantized values of a tensor (all of it). */
static float *dequant(const struct gguf_tensor *t, uint64_t *n)
{
    *n = (uint64_t)t->ne[0] * (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
    float *y = malloc(*n * sizeof *y);
    CHECK(y);
    CHECK_EQ(moe_dequantize(t->type, t->data, y, (int64_t)*n), 0);
    return y;
}

static void check_values(const char *quant)
{
    char path[512], args[128];
    snprintf(args, sizeof args, "--preset tiny --quant %s --router-skew 2", quant);
    CHECK_EQ(mkmodel(path, sizeof path, "w.gguf", args), 0);
    struct gguf_file *f;
    struct moe_model m;
    open_model(path, &f, &m);
    const double E = 256, L = 3, F = 128, QD = 256;
    const double s_out = fmin(0.5, 1 / sqrt(2 * L));
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        uint64_t n;
        float *y = dequant(t, &n);
        const int64_t ne0 = t->ne[0], rows = (int64_t)(n / (uint64_t)ne0), per = t->ne[1];
        double s = 0, s2 = 0;
        uint64_t cnt = 0;
        bool zero_row0 = strstr(t->name, "attn_output") || strstr(t->name, "ffn_down_exps");
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < ne0; c++) {
                float v = y[r * ne0 + c];
                CHECK_MSG(isfinite(v), "%s: non-finite value", t->name);
                if (zero_row0 && r % per == 0) {
                    CHECK_MSG(v == 0, "%s: row 0 of matrix %lld not zero", t->name,
                              (long long)(r / per));
                    continue;
                }
                if (c == 0 && (!strcmp(t->name, "token_embd.weight") || strstr(t->name, "norm") ||
                               strstr(t->name, "ffn_gate_inp")))
                    continue; /* the bias channel, checked below */
                s += v;
                s2 += (double)v * v;
                cnt++;
            }
        double mean = s / (double)cnt, sd = sqrt(s2 / (double)cnt - mean * mean);
        double want_mean = 0, want_sd;
        if (strstr(t->name, "norm")) {
            want_mean = 1;
            want_sd = 0.1;
            for (int64_t r = 0; r < rows; r++)
                CHECK_NEAR(y[r * ne0], 1.0, 1e-6);
        } else if (!strcmp(t->name, "token_embd.weight")) {
            want_sd = 1;
            for (int64_t r = 0; r < rows; r++)
                CHECK_MSG(fabsf(y[r * ne0] - 4.0f) < 0.05f, "token %lld channel 0 = %g",
                          (long long)r, y[r * ne0]);
        } else if (!strcmp(t->name, "output.weight"))
            want_sd = 3 / sqrt(E);
        else if (strstr(t->name, "attn_output"))
            want_sd = s_out / sqrt(QD);
        else if (strstr(t->name, "ffn_down_exps"))
            want_sd = s_out / sqrt(F);
        else if (strstr(t->name, "ffn_gate_inp")) {
            want_sd = 1 / sqrt(E);
            /* Channel 0: -skew * ln(1 + rank) / 4 over a permutation of the ranks. */
            int seen[16] = {0};
            for (int64_t e = 0; e < rows; e++) {
                double rank = exp(-y[e * ne0] * 4 / 2) - 1;
                long r = lround(rank);
                CHECK_MSG(fabs(rank - (double)r) < 1e-3 && r >= 0 && r < 16,
                          "%s: expert %lld bias %g is no rank", t->name, (long long)e, y[e * ne0]);
                seen[r]++;
            }
            for (int r = 0; r < 16; r++)
                CHECK_EQ(seen[r], 1);
        } else
            want_sd = 1 / sqrt(E);
        CHECK_MSG(fabs(mean - want_mean) < 0.1 * want_sd + 3 * want_sd / sqrt((double)cnt),
                  "%s: mean %g, want %g", t->name,
                  mean, want_mean);
        /* 4% for block scale variation, plus sampling noise for small tensors */
        double tol = 0.04 + 2.5 / sqrt((double)cnt);
        CHECK_MSG(fabs(sd / want_sd - 1) < tol, "%s (%s): sd %g, want %g", t->name,
                  moe_type_get(t->type)->name, sd, want_sd);
        free(y);
    }
    moe_model_free(&m);
    gguf_close(f);
}

TEST(mkmodel_values_f16)
{
    check_values("f16");
}

TEST(mkmodel_values_q8_0)
{
    check_values("q8_0");
}

TEST(mkmodel_values_q4_k_m)
{
    check_values("q4_k_m");
}

/* Share of top-k routings that go to each layer's most used quarter of experts, estimated from
 * router softmax top-k over random hidden states normalised like the model's (RMSNorm with
 * ffn_norm), with the bias channel at its embedding value. Returns the smallest share. */
static double routing_top_quarter_share(const struct moe_model *m, int n_tokens)
{
    const uint32_t E = m->hp.n_embd, X = m->hp.n_expert, K = m->hp.n_expert_used;
    double min_share = 1;
    float *x = malloc(E * sizeof *x), *w = malloc((size_t)E * X * sizeof *w), *g = malloc(E * 4);
    CHECK(x && w && g);
    uint64_t s = 12345;
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        const struct moe_layer *ly = &m->layers[l];
        CHECK_EQ(ly->ffn_gate_inp.type, MOE_TYPE_F32);
        memcpy(w, ly->ffn_gate_inp.data, (size_t)E * X * sizeof *w);
        memcpy(g, ly->ffn_norm.data, E * sizeof *g);
        long count[256] = {0};
        for (int t = 0; t < n_tokens; t++) {
            double ss = 0;
            for (uint32_t i = 0; i < E; i++) {
                /* Box-Muller from a 64-bit LCG: fine for an estimate. */
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                double u1 = ((s >> 11) + 1) * 0x1p-53;
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                double u2 = (s >> 11) * 0x1p-53;
                x[i] = (float)(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2));
                if (i == 0)
                    x[i] = 4.0f;
                ss += (double)x[i] * x[i];
            }
            double inv = 1 / sqrt(ss / E + m->hp.rms_eps);
            double logit[256];
            for (uint32_t e = 0; e < X; e++) {
                double acc = 0;
                for (uint32_t i = 0; i < E; i++)
                    acc += (double)w[(size_t)e * E + i] * x[i] * inv * g[i];
                logit[e] = acc;
            }
            /* softmax is monotonic: top-k of the probabilities is top-k of the logits */
            for (uint32_t k = 0; k < K; k++) {
                uint32_t best = 0;
                for (uint32_t e = 1; e < X; e++)
                    if (logit[e] > logit[best])
                        best = e;
                count[best]++;
                logit[best] = -INFINITY;
            }
        }
        /* sort counts descending */
        for (uint32_t i = 0; i < X; i++)
            for (uint32_t j = i + 1; j < X; j++)
                if (count[j] > count[i]) {
                    long tmp = count[i];
                    count[i] = count[j];
                    count[j] = tmp;
                }
        long top = 0, all = 0;
        for (uint32_t e = 0; e < X; e++) {
            all += count[e];
            if (e < X / 4)
                top += count[e];
        }
        double share = (double)top / (double)all;
        if (share < min_share)
            min_share = share;
    }
    free(x);
    free(w);
    free(g);
    return min_share;
}

TEST(mkmodel_routing_is_skewed)
{
    char path[512];
    struct gguf_file *f;
    struct moe_model m;
    CHECK_EQ(mkmodel(path, sizeof path, "r.gguf", "--preset tiny --quant q8_0"), 0);
    open_model(path, &f, &m);
    double share = routing_top_quarter_share(&m, 2000);
    fprintf(stderr, "default skew: top quarter share (min over layers) %.3f\n", share);
    CHECK_MSG(share > 0.6, "top quarter of experts takes only %.3f of routings", share);
    moe_model_free(&m);
    gguf_close(f);

    CHECK_EQ(mkmodel(path, sizeof path, "r0.gguf", "--preset tiny --quant q8_0 --router-skew 0"), 0);
    open_model(path, &f, &m);
    share = routing_top_quarter_share(&m, 2000);
    fprintf(stderr, "skew 0: top quarter share (min over layers) %.3f\n", share);
    CHECK_MSG(share < 0.45, "skew 0 still skewed: %.3f", share);
    moe_model_free(&m);
    gguf_close(f);
}

TEST(mkmodel_rejects_bad_arguments)
{
    char path[512];
    struct stat st;
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset huge"), 2);
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset tiny --quant q3_k"), 2);
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset tiny --seed -1"), 2);
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset tiny --threads 0"), 2);
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset tiny --router-skew nan"), 2);
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--quant f16"), 2);
    CHECK(stat(path, &st) != 0);
    /* A vocabulary that is not a GGUF: a clear failure and no output file left behind. */
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf", "--preset tiny --vocab tests/golden/README.md"), 1);
    CHECK(stat(path, &st) != 0);
    /* A model file works as a vocabulary source too (it has the tokenizer keys). */
    CHECK_EQ(mkmodel(path, sizeof path, "x.gguf",
                     "--preset tiny --vocab " GOLDEN_DIR "tiny-qwen3moe-Q8_0.gguf"), 0);
    CHECK(stat(path, &st) == 0);
}

/* The real forward pass (moed-worker's CPU engine) on real text routes like a trained model:
 * every layer's most used quarter of experts takes well over half of the routings. */
TEST(mkmodel_routing_skew_in_real_forward)
{
    char path[512], cmd[2048], *save = NULL;
    CHECK_EQ(mkmodel(path, sizeof path, "fw.gguf", "--preset tiny --quant q8_0 --seed 5"), 0);
    snprintf(cmd, sizeof cmd,
             "'%s' --model '%s' --prompt-file tests/golden/prompts/p2.txt -n 0 --routing-stats 2>&1",
             moe_test_bin("moed-worker"), path);
    int st;
    char *out = moe_test_run_shell(cmd, &st);
    int layers = 0;
    for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        const char *s = strstr(line, "top 4/16 experts: ");
        double share;
        if (strncmp(line, "layer", 5) || !s || sscanf(s, "top 4/16 experts: %lf%%", &share) != 1)
            continue;
        fprintf(stderr, "%s\n", line);
        CHECK_MSG(share > 55, "layer %d: top quarter takes only %.1f%%", layers, share);
        layers++;
    }
    free(out);
    CHECK_MSG(st == 0, "moed-worker failed (status %d)", st);
    CHECK_EQ(layers, 3);
}

static bool more_bits(uint32_t i, uint32_t n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The real-shape presets, metadata only (sparse files): shapes, hyperparameters and the
 * llama-quantize Q4_K_M mix that our model loader sees. */
static void check_real_preset(const char *preset, uint32_t L, uint32_t E, uint32_t H, uint32_t F,
                              double gib)
{
    char path[512], args[256], err[256];
    snprintf(args, sizeof args, "--preset %s --quant q4_k_m --no-data", preset);
    CHECK_EQ(mkmodel(path, sizeof path, "big.gguf", args), 0);
    struct gguf_file *f;
    struct moe_model m;
    open_model(path, &f, &m);
    CHECK_EQ(m.hp.n_layer, L);
    CHECK_EQ(m.hp.n_embd, E);
    CHECK_EQ(m.hp.n_head, H);
    CHECK_EQ(m.hp.n_head_kv, 4);
    CHECK_EQ(m.hp.head_dim, 128);
    CHECK_EQ(m.hp.n_expert, 128);
    CHECK_EQ(m.hp.n_expert_used, 8);
    CHECK_EQ(m.hp.expert_ff, F);
    CHECK_EQ(m.hp.n_vocab, 151936);
    CHECK_EQ(m.hp.n_ctx_train, 40960);
    CHECK_EQ(f->n_tensors, 3 + 12 * (uint64_t)L);
    uint32_t id;
    CHECK_EQ(gguf_get_u32(f, "tokenizer.ggml.eos_token_id", &id, err, sizeof err), 0);
    CHECK_EQ(id, 151645);
    CHECK_EQ(m.output.type, MOE_TYPE_Q6_K);
    CHECK_EQ(m.token_embd.type, MOE_TYPE_Q4_K);
    uint32_t n_q6 = 0;
    for (uint32_t l = 0; l < L; l++) {
        uint32_t want = more_bits(l, L) ? MOE_TYPE_Q6_K : MOE_TYPE_Q4_K;
        n_q6 += want == MOE_TYPE_Q6_K;
        CHECK_EQ(m.layers[l].attn_v.type, want);
        CHECK_EQ(m.layers[l].experts[0].down.type, want);
        CHECK_EQ(m.layers[l].experts[127].gate.type, MOE_TYPE_Q4_K);
        CHECK_EQ(m.layers[l].attn_q.type, MOE_TYPE_Q4_K);
        CHECK_EQ(m.layers[l].ffn_gate_inp.type, MOE_TYPE_F32);
    }
    CHECK(n_q6 * 20 >= L * 9 && n_q6 * 20 <= L * 11); /* "about half the layers" (24/48, 46/94) */
    CHECK_NEAR((double)f->size / (1 << 30), gib, 0.05);
    moe_model_free(&m);
    gguf_close(f);
}

TEST(mkmodel_qwen3_30b_a3b_layout)
{
    check_real_preset("qwen3-30b-a3b", 48, 2048, 32, 768, 17.28);
}

TEST(mkmodel_qwen3_235b_a22b_layout)
{
    check_real_preset("qwen3-235b-a22b", 94, 4096, 64, 1536, 132.39);
}

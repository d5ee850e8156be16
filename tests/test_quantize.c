/* Tests of `moectl quantize` (cli/quantize.c): files our reader and engine accept, the types
 * llama-quantize would choose (checked against the golden Q4_K_M that llama-quantize made),
 * logits of a quantized golden model against the golden F16 reference, thread-count
 * determinism, and usage errors. */
#include <dirent.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/engine_test.h"

#define GOLDEN_F16 GOLDEN "/models/tiny-qwen3moe-F16.gguf"
#define GOLDEN_Q4KM GOLDEN "/models/tiny-qwen3moe-Q4_K_M.gguf"

/* Runs bin/moectl with the NULL-terminated arguments, output to a log in the test's temp dir
 * (printed when the exit status is not the expected one). Returns the exit status. */
static int moectl(int expect, ...)
{
    const char *argv[16];
    int argc = 0;
    argv[argc++] = moe_test_bin("moectl");
    va_list ap;
    va_start(ap, expect);
    const char *a;
    while ((a = va_arg(ap, const char *)) && argc < 15)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    char log[512];
    snprintf(log, sizeof log, "%s/moectl.log", moe_test_tmpdir());
    int code = moe_test_run((char *const *)argv, log, log);
    CHECK(code >= 0);
    if (code != expect) {
        size_t n;
        char *text = moe_test_read_file_or_fail(log, &n);
        printf("moectl %s ... exited %d (expected %d):\n%s", argc > 1 ? argv[1] : "", code,
               expect, text);
        free(text);
    }
    return code;
}

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", moe_test_tmpdir(), name);
}

static uint32_t kv_u32(const struct gguf_file *f, const char *key)
{
    uint32_t v = 0;
    char err[128];
    CHECK_MSG(gguf_get_u32(f, key, &v, err, sizeof err) == 0, "%s: %s", key, err);
    return v;
}

/* Every KV of a is in b with the same type and, for scalars, strings and array sizes, the same
 * value; except the keys quantize rewrites. */
static void check_kvs_copied(const struct gguf_file *a, const struct gguf_file *b)
{
    for (uint64_t i = 0; i < a->n_kv; i++) {
        const struct gguf_kv *ka = &a->kv[i];
        if (!strcmp(ka->key, "general.file_type") ||
            !strcmp(ka->key, "general.quantization_version"))
            continue;
        const struct gguf_kv *kb = gguf_find_kv(b, ka->key);
        CHECK_MSG(kb, "KV %s not copied", ka->key);
        CHECK_EQ(kb->type, ka->type);
        if (ka->type == GGUF_STRING)
            CHECK(ka->v.str.len == kb->v.str.len &&
                  !memcmp(ka->v.str.p, kb->v.str.p, ka->v.str.len));
        else if (ka->type == GGUF_ARRAY)
            CHECK(ka->v.arr.type == kb->v.arr.type && ka->v.arr.n == kb->v.arr.n);
        else
            CHECK_MSG(ka->v.u64 == kb->v.u64, "KV %s changed", ka->key);
    }
}

static bool keeps_f32(const struct gguf_tensor *t)
{
    return t->n_dims < 2 || strstr(t->name, "ffn_gate_inp") != NULL;
}

/* Largest per-tensor ||q - x|| / ||x|| between a quantized file's weights and the source's. */
static double max_tensor_rel_err(const struct gguf_file *src, const struct gguf_file *q)
{
    double worst = 0;
    for (uint64_t i = 0; i < src->n_tensors; i++) {
        const struct gguf_tensor *a = &src->tensors[i];
        const struct gguf_tensor *b = gguf_find_tensor(q, a->name);
        CHECK(b);
        int64_t n = a->ne[0] * a->ne[1] * a->ne[2] * a->ne[3];
        float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
        CHECK(x && y);
        CHECK_EQ(moe_dequantize(a->type, a->data, x, n), 0);
        CHECK_EQ(moe_dequantize(b->type, b->data, y, n), 0);
        double rel = moe_test_rel_l2(y, x, (size_t)n);
        if (keeps_f32(a))
            CHECK_MSG(rel == 0.0, "%s changed (%g) though it is kept", a->name, rel);
        if (rel > worst)
            worst = rel;
        free(x);
        free(y);
    }
    return worst;
}

/* Quantizing the golden F16 model to Q8_0 gives a file our reader and model loader accept,
 * with Q8_0 matrices, F32 norms and router, all KVs copied and file_type 7, and logits within
 * 3e-2 of the golden F16 reference. */
TEST(quantize_golden_q8_0_parity)
{
    char out[512];
    tmp_path(out, sizeof out, "q8_0.gguf");
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, out, "q8_0", NULL), 0);

    struct gguf_file *src, *q;
    char err[256];
    CHECK_MSG(gguf_open(&src, GOLDEN_F16, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(gguf_open(&q, out, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(q->n_tensors, src->n_tensors);
    for (uint64_t i = 0; i < src->n_tensors; i++) {
        const struct gguf_tensor *a = &src->tensors[i], *b = &q->tensors[i];
        CHECK_STREQ(b->name, a->name);
        CHECK_EQ(b->n_dims, a->n_dims);
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            CHECK_EQ(b->ne[d], a->ne[d]);
        CHECK_MSG(b->type == (keeps_f32(a) ? MOE_TYPE_F32 : MOE_TYPE_Q8_0), "%s has type %s",
                  b->name, moe_type_get(b->type)->name);
    }
    check_kvs_copied(src, q);
    CHECK_EQ(kv_u32(q, "general.file_type"), 7);
    CHECK_EQ(kv_u32(q, "general.quantization_version"), 2);
    double werr = max_tensor_rel_err(src, q);
    printf("q8_0: worst per-tensor weight rel error %.3e\n", werr);
    CHECK(werr > 0 && werr < 1e-2);

    struct moe_model m;
    CHECK_MSG(moe_model_from_gguf(&m, q, err, sizeof err) == 0, "%s", err);
    /* All three golden prompts (about 300 positions), so that top-1 agreement is measured on
     * enough positions for one near-tie not to decide it. */
    static const char *const prompts[] = {"p1", "p2", "p3"};
    struct moe_engine *e = test_engine(&m, 512, 1, 0, 0);
    double num = 0, den = 0, same = 0, rows = 0;
    for (int p = 0; p < 3; p++) {
        struct golden_ref r;
        float *logits = golden_prefill(e, m.hp.n_vocab, &r, "F16", prompts[p]);
        double rel = moe_test_rel_l2(logits, r.logits, r.n_prompt * r.n_vocab);
        double top1 = top1_agreement(logits, r.logits, r.n_prompt, r.n_vocab);
        printf("quantize q8_0 vs golden F16 %s: n_prompt %zu rel-L2 %.3e top-1 %.1f%%\n",
               prompts[p], r.n_prompt, rel, 100.0 * top1);
        CHECK_MSG(rel <= 3e-2, "%s: rel-L2 %.3e", prompts[p], rel);
        for (size_t i = 0; i < r.n_prompt * r.n_vocab; i++) {
            double d = (double)logits[i] - r.logits[i];
            num += d * d;
            den += (double)r.logits[i] * r.logits[i];
        }
        same += top1 * (double)r.n_prompt;
        rows += (double)r.n_prompt;
        free(logits);
        golden_free(&r);
    }
    printf("quantize q8_0 vs golden F16 all: rel-L2 %.3e top-1 %.1f%%\n", sqrt(num / den),
           100.0 * same / rows);
    CHECK(sqrt(num / den) <= 3e-2);
    CHECK(same / rows >= 0.95);
    moe_engine_free(e);
    moe_model_free(&m);
    gguf_close(q);
    gguf_close(src);
}

/* The q4_k_m mix picks, tensor by tensor, the types llama-quantize picked for the golden
 * Q4_K_M file: Q6_K head, Q6_K attn_v/ffn_down in the use_more_bits layers, and the Q5_0/Q8_0
 * fallbacks for the 128-wide ffn_down_exps rows. */
TEST(quantize_q4_k_m_types_match_llama_quantize)
{
    char out[512];
    tmp_path(out, sizeof out, "q4_k_m.gguf");
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, out, "Q4_K_M", "--threads", "2", NULL), 0);
    struct gguf_file *ref, *q;
    char err[256];
    CHECK_MSG(gguf_open(&ref, GOLDEN_Q4KM, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(gguf_open(&q, out, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(q->n_tensors, ref->n_tensors);
    size_t n_q6 = 0;
    for (uint64_t i = 0; i < ref->n_tensors; i++) {
        const struct gguf_tensor *a = &ref->tensors[i];
        const struct gguf_tensor *b = gguf_find_tensor(q, a->name);
        CHECK_MSG(b, "%s missing", a->name);
        CHECK_MSG(a->type == b->type, "%s: %s, llama-quantize chose %s", a->name,
                  moe_type_get(b->type)->name, moe_type_get(a->type)->name);
        n_q6 += b->type == MOE_TYPE_Q6_K;
    }
    CHECK(n_q6 >= 2);
    CHECK_EQ(kv_u32(q, "general.file_type"), 15);
    struct moe_model m;
    CHECK_MSG(moe_model_from_gguf(&m, q, err, sizeof err) == 0, "%s", err);
    moe_model_free(&m);
    gguf_close(q);
    gguf_close(ref);
}

/* Pure K types fall back for rows that are not a multiple of 256 (golden ffn_down_exps rows
 * are 128 wide): Q5_K -> Q5_1 as in llama.cpp; Q5_K everywhere else. */
TEST(quantize_q5_k_fallback)
{
    char out[512];
    tmp_path(out, sizeof out, "q5_k.gguf");
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, out, "q5_k", NULL), 0);
    struct gguf_file *src, *q;
    char err[256];
    CHECK_MSG(gguf_open(&src, GOLDEN_F16, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(gguf_open(&q, out, err, sizeof err) == 0, "%s", err);
    size_t n_fallback = 0;
    for (uint64_t i = 0; i < q->n_tensors; i++) {
        const struct gguf_tensor *t = &q->tensors[i];
        uint32_t want = keeps_f32(t) ? MOE_TYPE_F32
                        : t->ne[0] % 256 ? MOE_TYPE_Q5_1 : MOE_TYPE_Q5_K;
        CHECK_MSG(t->type == want, "%s (ne0 %lld) has type %s", t->name, (long long)t->ne[0],
                  moe_type_get(t->type)->name);
        n_fallback += want == MOE_TYPE_Q5_1;
    }
    CHECK_EQ(n_fallback, 3); /* the three ffn_down_exps */
    double werr = max_tensor_rel_err(src, q);
    printf("q5_k: worst per-tensor weight rel error %.3e\n", werr);
    CHECK(werr > 0 && werr < 0.08);
    gguf_close(q);
    gguf_close(src);
}

/* The bytes do not depend on the thread count; an already quantized input needs
 * --allow-requantize. */
TEST(quantize_threads_deterministic_and_requantize)
{
    char a[512], b[512], c[512];
    tmp_path(a, sizeof a, "t1.gguf");
    tmp_path(b, sizeof b, "t3.gguf");
    tmp_path(c, sizeof c, "re.gguf");
    CHECK_EQ(moectl(0, "quantize", "--threads", "1", GOLDEN_F16, a, "q5_k_m", NULL), 0);
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, b, "q5_k_m", "--threads", "3", NULL), 0);
    size_t na, nb;
    char *da = moe_test_read_file_or_fail(a, &na), *db = moe_test_read_file_or_fail(b, &nb);
    CHECK_EQ(na, nb);
    CHECK(memcmp(da, db, na) == 0);
    free(da);
    free(db);

    CHECK_EQ(moectl(1, "quantize", a, c, "q4_0", NULL), 1);
    CHECK(access(c, F_OK) != 0);
    CHECK_EQ(moectl(0, "quantize", "--allow-requantize", a, c, "q4_0", NULL), 0);
    struct gguf_file *f;
    char err[256];
    CHECK_MSG(gguf_open(&f, c, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(kv_u32(f, "general.file_type"), 2);
    for (uint64_t i = 0; i < f->n_tensors; i++)
        CHECK(f->tensors[i].type == (keeps_f32(&f->tensors[i]) ? MOE_TYPE_F32 : MOE_TYPE_Q4_0));
    gguf_close(f);

    /* Back to F16 from a quantized file is a plain dequantization: no flag needed. */
    CHECK_EQ(moectl(0, "quantize", a, c, "f16", NULL), 0);
}

TEST(quantize_usage_errors)
{
    char out[512];
    tmp_path(out, sizeof out, "x.gguf");
    CHECK_EQ(moectl(2, "quantize", NULL), 2);
    CHECK_EQ(moectl(2, "quantize", GOLDEN_F16, out, NULL), 2);
    CHECK_EQ(moectl(2, "quantize", GOLDEN_F16, out, "q8_0", "extra", NULL), 2);
    CHECK_EQ(moectl(2, "quantize", GOLDEN_F16, out, "q3_k", NULL), 2);
    CHECK_EQ(moectl(2, "quantize", "--threads", "0", GOLDEN_F16, out, "q8_0", NULL), 2);
    CHECK_EQ(moectl(2, "quantize", "--threads", "x", GOLDEN_F16, out, "q8_0", NULL), 2);
    CHECK_EQ(moectl(2, "quantize", "--bogus", GOLDEN_F16, out, "q8_0", NULL), 2);
    CHECK(access(out, F_OK) != 0);
    CHECK_EQ(moectl(0, "quantize", "--help", NULL), 0);

    /* Run-time failures exit 1 and leave no output behind. */
    char missing[512], bad[512];
    tmp_path(missing, sizeof missing, "missing.gguf");
    CHECK_EQ(moectl(1, "quantize", missing, out, "q8_0", NULL), 1);
    tmp_path(bad, sizeof bad, "bad.gguf");
    moe_test_write_file(bad, "GGUF but not really", 19);
    CHECK_EQ(moectl(1, "quantize", bad, out, "q8_0", NULL), 1);
    CHECK(access(out, F_OK) != 0);

    /* Writing over the input would truncate the file under its own mapping. */
    char copy[512];
    tmp_path(copy, sizeof copy, "copy.gguf");
    size_t n;
    char *data = moe_test_read_file_or_fail(GOLDEN_F16, &n);
    moe_test_write_file(copy, data, n);
    CHECK_EQ(moectl(1, "quantize", copy, copy, "q8_0", NULL), 1);
    size_t n2;
    char *after = moe_test_read_file_or_fail(copy, &n2);
    CHECK(n2 == n && memcmp(after, data, n) == 0);
    free(after);
    free(data);
}

/* Every TYPE gives a file the model loader accepts, with the base type (or its llama.cpp
 * fallback for the 128-wide ffn_down_exps rows) in every matrix, the right general.file_type,
 * and weights within a bound that fits the type's bits. */
TEST_TIMEOUT(quantize_all_types, 300)
{
    static const struct {
        const char *name;
        uint32_t base, fallback, ftype;
        double max_err; /* per-tensor relative L2 of the weights */
    } cases[] = {
        {"f32", MOE_TYPE_F32, MOE_TYPE_F32, 0, 0.0},
        {"f16", MOE_TYPE_F16, MOE_TYPE_F16, 1, 0.0}, /* the source is F16: exact */
        {"bf16", MOE_TYPE_BF16, MOE_TYPE_BF16, 32, 4e-3},
        {"q8_0", MOE_TYPE_Q8_0, MOE_TYPE_Q8_0, 7, 1e-2},
        {"q4_0", MOE_TYPE_Q4_0, MOE_TYPE_Q4_0, 2, 0.15},
        {"q4_1", MOE_TYPE_Q4_1, MOE_TYPE_Q4_1, 3, 0.15},
        {"q5_0", MOE_TYPE_Q5_0, MOE_TYPE_Q5_0, 8, 0.08},
        {"q5_1", MOE_TYPE_Q5_1, MOE_TYPE_Q5_1, 9, 0.08},
        {"q4_k", MOE_TYPE_Q4_K, MOE_TYPE_Q5_0, 14, 0.15},
        {"q6_k", MOE_TYPE_Q6_K, MOE_TYPE_Q8_0, 18, 3e-2},
        {"q5_k_m", MOE_TYPE_Q5_K, MOE_TYPE_Q5_1, 17, 0.08},
    };
    struct gguf_file *src;
    char err[256];
    CHECK_MSG(gguf_open(&src, GOLDEN_F16, err, sizeof err) == 0, "%s", err);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char out[512];
        tmp_path(out, sizeof out, "all.gguf");
        CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, out, cases[c].name, NULL), 0);
        struct gguf_file *q;
        CHECK_MSG(gguf_open(&q, out, err, sizeof err) == 0, "%s: %s", cases[c].name, err);
        CHECK_EQ(kv_u32(q, "general.file_type"), cases[c].ftype);
        bool mix = strstr(cases[c].name, "_m") != NULL;
        for (uint64_t i = 0; i < q->n_tensors; i++) {
            const struct gguf_tensor *t = &q->tensors[i];
            uint32_t want = keeps_f32(t) ? MOE_TYPE_F32
                            : t->ne[0] % moe_type_get(cases[c].base)->blck ? cases[c].fallback
                            : cases[c].base;
            /* The mix puts Q6_K (or its Q8_0 fallback) on some tensors; checked elsewhere. */
            if (mix && (t->type == MOE_TYPE_Q6_K || t->type == MOE_TYPE_Q8_0))
                continue;
            CHECK_MSG(t->type == want, "%s: %s has type %s", cases[c].name, t->name,
                      moe_type_get(t->type)->name);
        }
        double werr = max_tensor_rel_err(src, q);
        printf("%-7s worst per-tensor weight rel error %.3e\n", cases[c].name, werr);
        CHECK_MSG(werr <= cases[c].max_err, "%s: weight error %.3e > %.1e", cases[c].name, werr,
                  cases[c].max_err);
        struct moe_model m;
        CHECK_MSG(moe_model_from_gguf(&m, q, err, sizeof err) == 0, "%s: %s", cases[c].name, err);
        moe_model_free(&m);
        gguf_close(q);
    }
    gguf_close(src);
}

/* The output is written under a temporary name and renamed at the end (a run that fails while
 * writing, out of disk say, leaves an existing OUT as it was instead of deleting it): a refused
 * run leaves OUT alone, a finished one replaces it whole, and no temporary file stays behind. */
TEST(quantize_replaces_the_output_whole)
{
    char out[512];
    tmp_path(out, sizeof out, "whole.gguf");
    moe_test_write_file(out, "old contents", 12);
    /* Refused (requantizing needs --allow-requantize): OUT untouched. */
    char q[512];
    tmp_path(q, sizeof q, "q8.gguf");
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, q, "q8_0", NULL), 0);
    CHECK_EQ(moectl(1, "quantize", q, out, "q4_0", NULL), 1);
    size_t n;
    char *d = moe_test_read_file_or_fail(out, &n);
    CHECK(n == 12 && !memcmp(d, "old contents", 12));
    free(d);
    CHECK_EQ(moectl(0, "quantize", GOLDEN_F16, out, "q8_0", NULL), 0);
    struct gguf_file *f;
    char err[256];
    CHECK_MSG(gguf_open(&f, out, err, sizeof err) == 0, "%s", err);
    gguf_close(f);
    DIR *dir = opendir(moe_test_tmpdir());
    CHECK(dir != NULL);
    struct dirent *de;
    while ((de = readdir(dir)))
        CHECK_MSG(!strstr(de->d_name, ".tmp."), "left behind: %s", de->d_name);
    closedir(dir);
}

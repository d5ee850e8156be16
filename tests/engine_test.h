/* Helpers shared by the engine, parity and worker-binary tests: golden files, model loading,
 * logit comparisons. Header-only (static inline) so each test file stays self-contained. */
#ifndef MOE_TEST_ENGINE_TEST_H
#define MOE_TEST_ENGINE_TEST_H

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/gguf.h"
#include "store/model.h"
#include "tests/harness.h"
#include "worker/engine.h"

#define GOLDEN "tests/golden"

struct golden_ref {
    int32_t *prompt;     /* prompt_tokens */
    size_t n_prompt;
    int32_t *greedy;     /* greedy_tokens */
    size_t n_greedy;
    uint32_t n_vocab;
    float *logits;       /* [n_prompt][n_vocab] */
};

static inline int32_t *json_ids(json_t *a, size_t *n)
{
    CHECK(json_is_array(a));
    *n = json_array_size(a);
    int32_t *ids = malloc(sizeof *ids * (*n + 1));
    CHECK(ids);
    for (size_t i = 0; i < *n; i++) {
        CHECK(json_is_integer(json_array_get(a, i)));
        ids[i] = (int32_t)json_integer_value(json_array_get(a, i));
    }
    return ids;
}

static inline void *test_read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f, "cannot open %s", path);
    CHECK(fseek(f, 0, SEEK_END) == 0);
    long n = ftell(f);
    CHECK(n >= 0);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    CHECK(buf);
    CHECK(fread(buf, 1, (size_t)n, f) == (size_t)n);
    buf[n] = 0;
    fclose(f);
    *size = (size_t)n;
    return buf;
}

/* model: "F16", "Q8_0", "Q4_K_M"; prompt: "p1".."p3". */
static inline void golden_load(struct golden_ref *r, const char *model, const char *prompt)
{
    char path[256];
    snprintf(path, sizeof path, GOLDEN "/refs/tiny-qwen3moe-%s.%s.json", model, prompt);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    CHECK_MSG(j, "%s: %s", path, je.text);
    r->prompt = json_ids(json_object_get(j, "prompt_tokens"), &r->n_prompt);
    r->greedy = json_ids(json_object_get(j, "greedy_tokens"), &r->n_greedy);
    r->n_vocab = (uint32_t)json_integer_value(json_object_get(j, "n_vocab"));
    json_decref(j);
    snprintf(path, sizeof path, GOLDEN "/refs/tiny-qwen3moe-%s.%s.logits.f32", model, prompt);
    size_t size;
    r->logits = test_read_file(path, &size);
    CHECK_EQ(size, r->n_prompt * r->n_vocab * sizeof(float));
}

static inline void golden_free(struct golden_ref *r)
{
    free(r->prompt);
    free(r->greedy);
    free(r->logits);
}

static inline void golden_model_path(char *buf, size_t n, const char *model)
{
    snprintf(buf, n, GOLDEN "/models/tiny-qwen3moe-%s.gguf", model);
}

struct test_model {
    struct gguf_file *f;
    struct moe_model m;
};

static inline void test_model_open(struct test_model *tm, const char *path)
{
    char err[256] = "";
    int rc = gguf_open(&tm->f, path, err, sizeof err);
    CHECK_MSG(rc == 0, "gguf_open %s: %s", path, err);
    rc = moe_model_from_gguf(&tm->m, tm->f, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_model_from_gguf %s: %s", path, err);
}

static inline void test_model_close(struct test_model *tm)
{
    moe_model_free(&tm->m);
    gguf_close(tm->f);
}

static inline struct moe_engine *test_engine(const struct moe_model *m, uint32_t n_ctx,
                                             uint32_t n_seq, uint32_t n_batch, int n_threads)
{
    struct moe_engine_opts o = {.n_ctx = n_ctx, .n_seq = n_seq, .n_batch = n_batch,
                                .n_threads = n_threads};
    struct moe_engine *e = NULL;
    char err[256] = "";
    int rc = moe_engine_init(&e, m, &o, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_engine_init: %s", err);
    return e;
}

/* Evaluates tokens[0..n) of one sequence from position pos0 in one batch; logits of every token
 * go to out[n][n_vocab]. */
static inline void test_prefill(struct moe_engine *e, int32_t seq, int32_t pos0,
                                const int32_t *tokens, uint32_t n, float *out)
{
    int32_t *pos = malloc(sizeof *pos * n), *sq = malloc(sizeof *sq * n);
    CHECK(pos && sq);
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = pos0 + (int32_t)i;
        sq[i] = seq;
    }
    struct moe_batch b = {.n = n, .token = tokens, .pos = pos, .seq = sq, .logits = NULL};
    int rc = moe_engine_forward(e, &b, out);
    CHECK_MSG(rc == 0, "moe_engine_forward: %s", moe_engine_errmsg(e));
    free(pos);
    free(sq);
}

/* ||a - b|| / ||b|| over n values, in double. */
static inline double rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline int32_t argmax_f(const float *x, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return (int32_t)best;
}

/* Share of rows (of n_vocab) whose argmax agrees. */
static inline double top1_agreement(const float *a, const float *b, size_t rows, size_t n_vocab)
{
    size_t same = 0;
    for (size_t r = 0; r < rows; r++)
        same += argmax_f(a + r * n_vocab, n_vocab) == argmax_f(b + r * n_vocab, n_vocab);
    return rows ? (double)same / (double)rows : 1.0;
}

#endif

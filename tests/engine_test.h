/* Helpers shared by the engine, parity and worker-binary tests: golden files, model loading,
 * logit comparisons (rel-L2 and argmax are in tests/harness.h). Header-only (static inline) so
 * each test file stays self-contained. */
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

/* The tokens of a golden reference only (r->logits = NULL).
 * model: "F16", "Q8_0", "Q4_K_M"; prompt: "p1".."p3". */
static inline void golden_load_tokens(struct golden_ref *r, const char *model, const char *prompt)
{
    char path[256];
    snprintf(path, sizeof path, GOLDEN "/refs/tiny-qwen3moe-%s.%s.json", model, prompt);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    CHECK_MSG(j, "%s: %s", path, je.text);
    r->prompt = json_ids(json_object_get(j, "prompt_tokens"), &r->n_prompt);
    r->greedy = json_ids(json_object_get(j, "greedy_tokens"), &r->n_greedy);
    r->n_vocab = (uint32_t)json_integer_value(json_object_get(j, "n_vocab"));
    r->logits = NULL;
    json_decref(j);
}

/* The tokens and the reference logits. */
static inline void golden_load(struct golden_ref *r, const char *model, const char *prompt)
{
    golden_load_tokens(r, model, prompt);
    char path[256];
    snprintf(path, sizeof path, GOLDEN "/refs/tiny-qwen3moe-%s.%s.logits.f32", model, prompt);
    size_t size;
    r->logits = (float *)moe_test_read_file_or_fail(path, &size);
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

/* model: "F16", "Q8_0", "Q4_K_M": the golden tiny model of that type. */
static inline void test_model_open_golden(struct test_model *tm, const char *model)
{
    char path[256];
    golden_model_path(path, sizeof path, model);
    test_model_open(tm, path);
}

static inline void test_model_close(struct test_model *tm)
{
    moe_model_free(&tm->m);
    gguf_close(tm->f);
}

/* A tolerance of the CPU engine's own tests (against a float64 reference, prefill vs decode,
 * interleaved vs alone), widened to the GPU parity threshold on a GPU: there the KV cache is f16,
 * sums run in another order, and prompt steps may multiply on tensor cores with f16-rounded
 * operands (worker/cuda/gemm.h), about 1e-4..1e-3 apart (the golden thresholds do not change). */
static inline double test_consistency_tol(double cpu_tol)
{
    const char *d = getenv("MOE_TEST_DEVICE");
    return d && strcmp(d, "cpu") && cpu_tol < 2e-3 ? 2e-3 : cpu_tol;
}

static inline struct moe_engine *test_engine(const struct moe_model *m, uint32_t n_ctx,
                                             uint32_t n_seq, uint32_t n_batch, int n_threads)
{
    /* MOE_TEST_DEVICE=cuda:0 runs the engine tests on a GPU with the same thresholds. */
    struct moe_engine_opts o = {.n_ctx = n_ctx, .n_seq = n_seq, .n_batch = n_batch,
                                .n_threads = n_threads, .device = getenv("MOE_TEST_DEVICE")};
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

/* Loads the golden reference of (model, prompt) into r and evaluates its prompt in one batch as
 * sequence 0 of e, from an empty cache. Returns the logits [n_prompt][n_vocab] (malloc'ed). */
static inline float *golden_prefill(struct moe_engine *e, uint32_t n_vocab, struct golden_ref *r,
                                    const char *model, const char *prompt)
{
    golden_load(r, model, prompt);
    CHECK_EQ(r->n_vocab, n_vocab);
    float *out = malloc(sizeof(float) * r->n_prompt * r->n_vocab);
    CHECK(out);
    moe_engine_seq_clear(e, 0);
    test_prefill(e, 0, 0, r->prompt, (uint32_t)r->n_prompt, out);
    return out;
}

/* Share of rows (of n_vocab) whose argmax agrees. */
static inline double top1_agreement(const float *a, const float *b, size_t rows, size_t n_vocab)
{
    return rows ? (double)moe_test_top1_agree(a, b, rows, n_vocab) / (double)rows : 1.0;
}

/* Prints rel-L2 and top-1 agreement of got against ref (both [rows][n_vocab]) after `label`, and
 * checks them against the bounds. */
static inline void check_logits(const char *label, const float *got, const float *ref, size_t rows,
                                size_t n_vocab, double max_rel, double min_top1)
{
    double rel = moe_test_rel_l2(got, ref, rows * n_vocab);
    double top1 = top1_agreement(got, ref, rows, n_vocab);
    printf("%s rows %zu rel-L2 %.3e top-1 %.1f%%\n", label, rows, rel, 100.0 * top1);
    fflush(stdout);
    CHECK_MSG(rel <= max_rel, "%s: rel-L2 %.3e > %.1e", label, rel, max_rel);
    CHECK_MSG(top1 >= min_top1, "%s: top-1 %.3f < %.2f", label, top1, min_top1);
}

#endif

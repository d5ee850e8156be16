/* Constrained sampling's cost per token (docs/api.md, structured output): the grammar mask over a
 * whole vocabulary, which a worker computes on the host every step of a job with a grammar, and
 * the state's advance by the chosen token.
 *
 *   build/bench/bench_grammar [VOCAB.gguf] [--tokens N] [--seed S]
 *
 * VOCAB.gguf: any GGUF with a tokenizer (default tests/golden/tokenizer/qwen3-vocab.gguf, Qwen3's
 * 151,669-token vocabulary). For each grammar (the json_object one and three JSON schemas made
 * into grammars as the daemon makes them) it generates N tokens: each step masks the vocabulary,
 * draws one allowed token at random (uniformly, a harder walk than a model's: long strings,
 * deep nesting), advances the state, and starts a new document when only the end is allowed.
 * Prints per-step mask time (mean, p50, p99), advance time, allowed tokens, and the stack count. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "store/err.h"
#include "store/gguf.h"
#include "store/grammar.h"
#include "store/io.h"
#include "store/json_schema.h"
#include "worker/batcher.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static const char *const SCHEMAS[][2] = {
    {"person", "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
               "\"age\":{\"type\":\"integer\",\"minimum\":0},\"email\":{\"type\":\"string\"},"
               "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
               "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}"},
    {"nested", "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"},"
               "\"items\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
               "\"sku\":{\"type\":\"string\"},\"qty\":{\"type\":\"number\"},"
               "\"kind\":{\"enum\":[\"book\",\"tool\",\"food\"]}},\"required\":[\"sku\",\"qty\","
               "\"kind\"]}},\"note\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}},"
               "\"required\":[\"id\",\"items\"]}"},
    {"enum", "{\"type\":\"object\",\"properties\":{\"answer\":{\"enum\":[\"yes\",\"no\","
             "\"maybe\",\"not sure\"]},\"confidence\":{\"type\":\"number\"}},"
             "\"required\":[\"answer\",\"confidence\"]}"},
};

static int run(const char *name, const char *gbnf, const struct moe_token_bytes *tb, int n_tok)
{
    char err[256];
    struct moe_grammar *g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
    if (!g) {
        fprintf(stderr, "bench_grammar: %s: %s\n", name, err);
        return 1;
    }
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    uint8_t *mask = malloc(tb->n);
    double *tm = malloc(sizeof(double) * (size_t)n_tok), adv = 0;
    uint32_t *ok = malloc(sizeof(uint32_t) * tb->n);
    int rc = 1;
    if (!st || !mask || !tm || !ok) {
        fprintf(stderr, "bench_grammar: %s: %s\n", name, st ? "out of memory" : err);
        goto out;
    }
    uint64_t allowed_sum = 0, stacks_sum = 0;
    int docs = 0, steps = 0;
    while (steps < n_tok) {
        double t0 = moe_now_s();
        long allowed = moe_grammar_mask(st, tb->trie, mask);
        tm[steps] = moe_now_s() - t0;
        if (allowed < 0) {
            fprintf(stderr, "bench_grammar: %s: %s\n", name, moe_grammar_state_error(st));
            goto out;
        }
        uint32_t n_ok = 0;
        for (uint32_t i = 0; i < tb->n; i++)
            if (mask[i] && tb->len[i])
                ok[n_ok++] = i;
        allowed_sum += (uint64_t)allowed;
        stacks_sum += moe_grammar_state_n_stacks(st);
        steps++;
        if (n_ok == 0) { /* only the end: a new document */
            moe_grammar_state_free(st);
            st = moe_grammar_state_new(g, err, sizeof err);
            if (!st) {
                fprintf(stderr, "bench_grammar: %s: %s\n", name, err);
                goto out;
            }
            docs++;
            continue;
        }
        const uint32_t t = ok[rnd() % n_ok];
        t0 = moe_now_s();
        if (moe_grammar_state_accept_bytes(st, tb->tok[t], tb->len[t]) != 1) {
            fprintf(stderr, "bench_grammar: %s: an allowed token was refused\n", name);
            goto out;
        }
        adv += moe_now_s() - t0;
    }
    qsort(tm, (size_t)n_tok, sizeof *tm, cmp_d);
    double sum = 0;
    for (int i = 0; i < n_tok; i++)
        sum += tm[i];
    printf("%-12s %6d steps %4d documents  mask %8.1f us mean  %8.1f p50  %8.1f p99  advance %6.1f "
           "us  allowed %8.1f  stacks %.1f\n",
           name, n_tok, docs, 1e6 * sum / n_tok, 1e6 * tm[n_tok / 2],
           1e6 * tm[(int)(0.99 * (n_tok - 1))], 1e6 * adv / n_tok,
           (double)allowed_sum / n_tok, (double)stacks_sum / n_tok);
    rc = 0;
out:
    moe_grammar_state_free(st);
    moe_grammar_free(g);
    free(mask), free(tm), free(ok);
    return rc;
}

int main(int argc, char **argv)
{
    const char *path = "tests/golden/tokenizer/qwen3-vocab.gguf";
    int n_tok = 400;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            n_tok = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            rng = strtoull(argv[++i], NULL, 10) | 1;
        else if (argv[i][0] != '-')
            path = argv[i];
        else {
            fprintf(stderr, "usage: bench_grammar [VOCAB.gguf] [--tokens N] [--seed S]\n");
            return 2;
        }
    }
    if (n_tok < 1)
        n_tok = 1;
    char err[512];
    struct gguf_file *f = NULL;
    if (gguf_open(&f, path, err, sizeof err)) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        return 1;
    }
    double t0 = moe_now_s();
    struct moe_token_bytes *tb = moe_token_bytes_new(f, err, sizeof err);
    if (!tb) {
        fprintf(stderr, "bench_grammar: %s\n", err);
        return 1;
    }
    printf("vocabulary %s: %u tokens, trie of %u nodes, built in %.1f ms\n", path, tb->n,
           moe_grammar_vocab_n_nodes(tb->trie), 1e3 * (moe_now_s() - t0));
    int rc = run("json_object", moe_json_object_gbnf(), tb, n_tok);
    for (size_t i = 0; !rc && i < sizeof SCHEMAS / sizeof SCHEMAS[0]; i++) {
        json_error_t je;
        json_t *schema = json_loads(SCHEMAS[i][1], 0, &je);
        char *gbnf = NULL;
        if (!schema || moe_json_schema_to_gbnf(schema, &gbnf, err, sizeof err)) {
            fprintf(stderr, "bench_grammar: schema %s: %s\n", SCHEMAS[i][0], schema ? err : je.text);
            return 1;
        }
        rc = run(SCHEMAS[i][0], gbnf, tb, n_tok);
        free(gbnf);
        json_decref(schema);
    }
    moe_token_bytes_free(tb);
    gguf_close(f);
    return rc;
}

/* Helpers for the grammar tests: whole-string matching and a synthetic vocabulary. */
#ifndef MOE_TESTS_GRAMMAR_TEST_H
#define MOE_TESTS_GRAMMAR_TEST_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/harness.h"
#include "store/grammar.h"
#include "store/json_schema.h"

/* 1 when the grammar matches all of s (byte by byte), 0 when not, -1 on a limit. */
static inline int gt_match_n(const struct moe_grammar *g, const char *s, size_t n)
{
    char err[256];
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    if (!st)
        return -1;
    int rc = 1;
    for (size_t i = 0; i < n && rc == 1; i++)
        rc = moe_grammar_state_accept_bytes(st, s + i, 1);
    if (rc == 1)
        rc = moe_grammar_state_is_accepting(st) ? 1 : 0;
    moe_grammar_state_free(st);
    return rc;
}

static inline int gt_match(const struct moe_grammar *g, const char *s)
{
    return gt_match_n(g, s, strlen(s));
}

static inline const char *gt_json_object_gbnf(void) { return moe_json_object_gbnf(); }

struct gt_vocab {
    char **tok;
    uint32_t *len;
    uint8_t *eog;
    uint32_t n;
};

static inline void gt_vocab_set(struct gt_vocab *v, uint32_t i, const char *s, size_t n)
{
    v->tok[i] = malloc(n + 1);
    memcpy(v->tok[i], s, n);
    v->tok[i][n] = '\0';
    v->len[i] = (uint32_t)n;
}

/* n tokens shaped like a BPE vocabulary of JSON and prose: the 256 single bytes, JSON pieces,
 * multi-byte characters and pieces of them, words with and without a leading space or quote,
 * numbers; the last two are end-of-generation tokens and one token has no bytes. Uses the test
 * RNG (seed it first). */
static inline void gt_vocab_synthetic(struct gt_vocab *v, uint32_t n)
{
    static const char *fixed[] = {
        "{", "}", "[", "]", "\"", ":", ",", " ", "\n", "  ", "\t", "{\"", "\":", "\",", "\": \"",
        "\": ", ", \"", "},", "}]", "]}", "true", "false", "null", " true", " null", "0", "1", "12",
        "3.14", "-", "e+", "E", ".", "é", "€", "😀", "\xe2\x82", "\xac", "\xf0\x9f", "\x98\x80",
        "\\n", "\\\"", "\\u00", "\\", "\"}", "\"]", "α", "βγ", " \"", "\n  ", "\n    \"", "  }",
        "\"\n}", "a", "ab", "abc", "x", "name", " name", "\"name", "age", "\"id\"", "2024-01-",
        "-01", ":00", "T12", "Z", "\xed\xa0\x80", "\xed", "\xed\x9f", "\xc0\x80", "\xf4\x90",
    };
    static const char *mb[] = {"é", "ü", "€", "😀", "α", "ω", "中", "\xe2\x82", "\xac"};
    static const char letters[] = "etaoinshrdlucmfwypvbgkjqxzETAONS_";
    v->n = n;
    v->tok = calloc(n, sizeof *v->tok);
    v->len = calloc(n, sizeof *v->len);
    v->eog = calloc(n, 1);
    uint32_t i = 0;
    for (; i < 256 && i < n; i++) {
        char b = (char)i;
        gt_vocab_set(v, i, &b, 1);
    }
    for (size_t k = 0; k < sizeof fixed / sizeof *fixed && i < n; k++, i++)
        gt_vocab_set(v, i, fixed[k], strlen(fixed[k]));
    char buf[64];
    for (; i < n; i++) {
        size_t m = 0;
        uint32_t r = moe_test_rng_u32() % 100;
        if (r < 45)
            buf[m++] = ' ';
        else if (r < 52)
            buf[m++] = '"';
        else if (r < 55)
            buf[m++] = '\n';
        uint32_t kind = moe_test_rng_u32() % 100;
        if (kind < 8) {
            int d = 1 + (int)(moe_test_rng_u32() % 4);
            for (int k = 0; k < d; k++)
                buf[m++] = (char)('0' + moe_test_rng_u32() % 10);
        } else {
            int w = 1 + (int)(moe_test_rng_u32() % 9);
            for (int k = 0; k < w && m < 40; k++) {
                if (moe_test_rng_u32() % 30 == 0) {
                    const char *c = mb[moe_test_rng_u32() % (sizeof mb / sizeof *mb)];
                    memcpy(buf + m, c, strlen(c));
                    m += strlen(c);
                } else {
                    buf[m++] = letters[moe_test_rng_u32() % (sizeof letters - 1)];
                }
            }
        }
        uint32_t tail = moe_test_rng_u32() % 100;
        if (tail < 5)
            buf[m++] = '"';
        else if (tail < 8)
            buf[m++] = ',';
        else if (tail < 10) {
            buf[m++] = '"';
            buf[m++] = ':';
        }
        gt_vocab_set(v, i, buf, m);
    }
    if (n > 300) {
        gt_vocab_set(v, n - 1, "<|im_end|>", 10);
        v->eog[n - 1] = 1;
        gt_vocab_set(v, n - 2, "<|endoftext|>", 13);
        v->eog[n - 2] = 1;
        gt_vocab_set(v, n - 3, "", 0);
    }
}

static inline void gt_vocab_free(struct gt_vocab *v)
{
    for (uint32_t i = 0; i < v->n; i++)
        free(v->tok[i]);
    free(v->tok);
    free(v->len);
    free(v->eog);
}

#endif

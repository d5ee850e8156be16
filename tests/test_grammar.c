/* GBNF parser, matcher and token mask (store/grammar.c). */
#include <stdlib.h>
#include <string.h>

#include "store/gguf.h"
#include "store/tokenizer.h"
#include "tests/grammar_test.h"
#include "tests/harness.h"

/* ---------------------------------------------------------------- parser */

TEST(grammar_parses_the_gbnf_subset)
{
    static const char *ok[] = {
        "root ::= \"a\"",
        "root ::= \"a\" | \"b\" | ",
        "root ::= ( \"a\" | [b-d] )* \"e\"+ \"f\"? \"g\"{2} \"h\"{1,} \"i\"{0,3} \"j\"{,2}\n",
        "# comment\nroot ::= x # trailing\nx ::= [^\"\\\\] # class\n\n",
        "root ::= \"\\n\\t\\r\\\\\\\"\\x41\\u00e9\\U0001F600\"",
        "root ::= [\\x00-\\x1f\\]\\[\\-] .",
        "root ::= (\n  \"a\"\n  | \"b\"\n)\n",
        "root ::= a-b_c\na-b_c ::= \"x\" |\n    \"y\"",
        "root ::= \"é€😀\" [α-ω]",
        "root ::= x\nx ::= \"(\" x \")\" | ",
        "root ::= ()",
        "root ::= [] | \"a\"",
        "root ::= \"ab\"{3,5}",
        "root ::= (\"a\" \"b\"?)+ \"c\"",
        "root ::= \"a\"\r\nb ::= \"c\"\r\n",
    };
    char err[256];
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        struct moe_grammar *g = moe_grammar_parse(ok[i], strlen(ok[i]), err, sizeof err);
        CHECK_MSG(g != NULL, "grammar %zu: %s", i, err);
        moe_grammar_free(g);
    }
}

TEST(grammar_rejects_malformed_with_position)
{
    static const struct {
        const char *text, *msg;
    } bad[] = {
        {"", "no 'root'"},
        {"x ::= \"a\"", "no 'root'"},
        {"root ::= foo", "line 1, column 10: undefined rule 'foo'"},
        {"root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule 'root' is defined twice"},
        {"root ::= \"abc", "unterminated string"},
        {"root ::= [abc", "unterminated character class"},
        {"root ::= (\"a\"", "unclosed '('"},
        {"root ::= \"a\")", "unbalanced ')'"},
        {"root = \"a\"", "expected '::='"},
        {"root ::= * \"a\"", "'*' must follow an item"},
        {"root ::= \"a\"{3,2}", "max < min"},
        {"root ::= \"a\"{100000}", "repetition bound"},
        {"root ::= \"a\"{x}", "expected a number"},
        {"root ::= \"a\"{2", "expected '}'"},
        {"root ::= \"\\q\"", "unknown escape"},
        {"root ::= \"\\x4\"", "needs 2 hex digits"},
        {"root ::= \"\\U00110000\"", "out of range"},
        {"root ::= [z-a]", "reversed"},
        {"root ::= \"\xff\"", "invalid UTF-8"},
        {"root ::= root \"a\" | \"b\"", "left recursion"},
        {"root ::= x\nx ::= y \"a\"\ny ::= \"b\"? x", "left recursion"},
        {"root ::= (\"a\"?)*", "left recursion"},
        {"root ::= \"a\" ;", "unexpected ';'"},
        {"::= \"a\"", "expected a rule name"},
        {"root ::= \"a\"\n  | \"b\"", "expected a rule name"},
    };
    char err[256];
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct moe_grammar *g = moe_grammar_parse(bad[i].text, strlen(bad[i].text), err, sizeof err);
        CHECK_MSG(g == NULL, "grammar %zu parsed: %s", i, bad[i].text);
        CHECK_MSG(strstr(err, bad[i].msg) != NULL, "grammar %zu: '%s' lacks '%s'", i, err,
                  bad[i].msg);
    }
}

TEST(grammar_limits)
{
    char err[256];
    /* nesting */
    char deep[400];
    size_t n = 0;
    for (int i = 0; i < 100; i++)
        deep[n++] = '(';
    memcpy(deep + n, "\"a\"", 3);
    n += 3;
    for (int i = 0; i < 100; i++)
        deep[n++] = ')';
    char *text = malloc(n + 16);
    memcpy(text, "root ::= ", 9);
    memcpy(text + 9, deep, n);
    struct moe_grammar *g = moe_grammar_parse(text, n + 9, err, sizeof err);
    CHECK(g == NULL);
    CHECK(strstr(err, "nested deeper") != NULL);
    free(text);
    /* elements: repetitions are expanded (nested ones only multiply the matching work, which
     * the state limits) */
    const char *nested = "root ::= ((((\"abcdefgh\"{9000}){9000}){9000}){9000})";
    g = moe_grammar_parse(nested, strlen(nested), err, sizeof err);
    CHECK_MSG(g != NULL, "%s", err);
    moe_grammar_free(g);
    char *big = malloc(120 * 12 + 16);
    strcpy(big, "root ::=");
    for (int i = 0; i < 120; i++)
        strcat(big, " \"a\"{9000}");
    g = moe_grammar_parse(big, strlen(big), err, sizeof err);
    CHECK(g == NULL);
    CHECK(strstr(err, "too large") != NULL);
    free(big);
    /* rules */
    const char *many = "root ::= \"a\"{0,9000}";
    g = moe_grammar_parse(many, strlen(many), err, sizeof err);
    CHECK(g == NULL);
    CHECK(strstr(err, "rules") != NULL);
    /* size */
    size_t len = MOE_GRAMMAR_MAX_TEXT + 1;
    char *huge = malloc(len);
    memset(huge, ' ', len);
    g = moe_grammar_parse(huge, len, err, sizeof err);
    CHECK(g == NULL);
    CHECK(strstr(err, "longer than") != NULL);
    free(huge);
}

/* ---------------------------------------------------------------- matcher */

TEST(grammar_matches_strings)
{
    static const struct {
        const char *grammar;
        const char *yes[6];
        const char *no[6];
    } cases[] = {
        {"root ::= \"ab\" | \"cd\"", {"ab", "cd"}, {"", "a", "abc", "ac", "cdab"}},
        {"root ::= [a-c]* \"x\"", {"x", "ax", "abcabcx"}, {"", "a", "dx", "xx"}},
        {"root ::= \"a\"+", {"a", "aaaa"}, {"", "b", "aab"}},
        {"root ::= \"a\"? \"b\"", {"b", "ab"}, {"aab", "a", ""}},
        {"root ::= \"ab\"{2,3}", {"abab", "ababab"}, {"ab", "abababab", "aba"}},
        {"root ::= \"a\"{3}", {"aaa"}, {"aa", "aaaa"}},
        {"root ::= \"a\"{2,}", {"aa", "aaaaaaa"}, {"a", ""}},
        {"root ::= \"a\"{,2} \"b\"", {"b", "ab", "aab"}, {"aaab"}},
        {"root ::= [^\"\\\\]+", {"x", "hello world", "é"}, {"\"", "\\", "a\"b"}},
        {"root ::= x\nx ::= \"(\" x \")\" | \"\"", {"", "()", "(())", "((()))"}, {"(", "())", ")("}},
        {"root ::= . .", {"ab", "é€", "😀a"}, {"a", "abc"}},
        {"root ::= [α-ω]+ \"!\"", {"αβγ!", "ω!"}, {"a!", "Ω!", "αβγ"}},
        {"root ::= \"\\u00e9\\U0001F600\\x41\"", {"é😀A"}, {"é😀", "e😀A"}},
        {"root ::= ( \"a\" | \"b\" \"c\" )* \"d\"", {"d", "abcad", "bcbcd"}, {"bd", "abc"}},
        {"root ::= (\"a\" \"b\"?)+ \"c\"", {"ac", "abac", "aac"}, {"bc", "c"}},
        {"root ::= [^a-z] [\\-] [\\]]", {"A-]", "é-]"}, {"a-]", "A+]"}},
    };
    char err[256];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct moe_grammar *g = moe_grammar_parse(cases[i].grammar, strlen(cases[i].grammar), err,
                                                  sizeof err);
        CHECK_MSG(g != NULL, "%s: %s", cases[i].grammar, err);
        for (int k = 0; k < 6 && cases[i].yes[k]; k++)
            CHECK_MSG(gt_match(g, cases[i].yes[k]) == 1, "%s should match '%s'",
                      cases[i].grammar, cases[i].yes[k]);
        for (int k = 0; k < 6 && cases[i].no[k]; k++)
            CHECK_MSG(gt_match(g, cases[i].no[k]) != 1, "%s should not match '%s'",
                      cases[i].grammar, cases[i].no[k]);
        moe_grammar_free(g);
    }
}

TEST(grammar_accepts_at_any_byte_split)
{
    const char *gs = "root ::= \"{\" (\"é\" | [α-ω] | \"😀\" | [a-z])* \"}\"";
    char err[256];
    struct moe_grammar *g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    CHECK_MSG(g != NULL, "%s", err);
    const char *text = "{aé😀βz😀}";
    size_t n = strlen(text);
    /* every split into up to three pieces, including inside the multi-byte characters */
    for (size_t a = 0; a <= n; a++) {
        for (size_t b = a; b <= n; b++) {
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            CHECK(st != NULL);
            CHECK_EQ(moe_grammar_state_accept_bytes(st, text, a), 1);
            CHECK_EQ(moe_grammar_state_accept_bytes(st, text + a, b - a), 1);
            CHECK(!moe_grammar_state_is_accepting(st) || b == n);
            CHECK_EQ(moe_grammar_state_accept_bytes(st, text + b, n - b), 1);
            CHECK(moe_grammar_state_is_accepting(st));
            moe_grammar_state_free(st);
        }
    }
    /* in the middle of a code point the state is not accepting, and a bad byte is rejected */
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "{\xc3", 2), 1);
    CHECK(!moe_grammar_state_is_accepting(st));
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "a", 1), 0);   /* not a continuation byte */
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "\xa0", 1), 0); /* U+00E0 is not allowed */
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "\xa9}", 2), 1); /* é */
    CHECK(moe_grammar_state_is_accepting(st));
    CHECK(!moe_grammar_state_can_continue(st));
    moe_grammar_state_free(st);
    /* a lead byte no allowed character starts with is rejected at once */
    st = moe_grammar_state_new(g, err, sizeof err);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "{\xe2", 2), 0); /* U+2000..U+2FFF */
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "{\xce", 2), 1); /* U+0380..U+03BF: α.. */
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "\x80", 1), 0);  /* U+0380 */
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "\xb1", 1), 1);  /* α */
    moe_grammar_state_free(st);
    moe_grammar_free(g);
    /* bytes that are not UTF-8: overlong forms, surrogates, past U+10FFFF, stray continuation */
    gs = "root ::= .*";
    g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    static const char *bad[] = {"\xc0\x80", "\xe0\x80\x80", "\xed\xa0", "\xf4\x90", "\x80", "\xff"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK_MSG(gt_match(g, bad[i]) != 1, "bad UTF-8 %zu accepted", i);
    CHECK_EQ(gt_match(g, "\xed\x9f\xbf\xee\x80\x80\xf4\x8f\xbf\xbf"), 1); /* U+D7FF U+E000 U+10FFFF */
    moe_grammar_free(g);
}

TEST(grammar_rejection_leaves_the_state_unchanged)
{
    const char *gs = "root ::= \"abc\" \"d\"*";
    char err[256];
    struct moe_grammar *g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "ab", 2), 1);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "cx", 2), 0);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "c", 1), 1);
    CHECK(moe_grammar_state_is_accepting(st));
    struct moe_grammar_state *cl = moe_grammar_state_clone(st);
    CHECK_EQ(moe_grammar_state_accept_bytes(cl, "e", 1), 0);
    CHECK_EQ(moe_grammar_state_accept_bytes(cl, "dd", 2), 1);
    CHECK_EQ(moe_grammar_state_accept_bytes(st, "d", 1), 1);
    for (int i = 0; i < 200000; i++) /* long outputs stay in bounded memory */
        CHECK_EQ(moe_grammar_state_accept_bytes(st, "d", 1), 1);
    CHECK(moe_grammar_state_is_accepting(st));
    CHECK(moe_grammar_state_is_accepting(cl));
    moe_grammar_state_free(cl);
    moe_grammar_state_free(st);
    moe_grammar_free(g);
}

TEST(grammar_state_limits)
{
    char err[256];
    /* nesting of the text past MOE_GRAMMAR_MAX_DEPTH */
    const char *gs = "root ::= x\nx ::= \"(\" x \")\" | \"a\"";
    struct moe_grammar *g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    int rc = 1, i;
    for (i = 0; i < 10000 && rc == 1; i++)
        rc = moe_grammar_state_accept_bytes(st, "(", 1);
    CHECK_EQ(rc, -1);
    CHECK(strstr(moe_grammar_state_error(st), "deeper") != NULL);
    moe_grammar_state_free(st);
    moe_grammar_free(g);
    /* ambiguity: 2^k ways to split a run of a's */
    gs = "root ::= (x | y)*\nx ::= \"a\"\ny ::= \"a\"";
    g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    CHECK(g != NULL);
    st = moe_grammar_state_new(g, err, sizeof err);
    for (i = 0; i < 100; i++)
        CHECK_EQ(moe_grammar_state_accept_bytes(st, "a", 1), 1); /* deduplicated: stays small */
    CHECK(moe_grammar_state_n_stacks(st) < 10);
    moe_grammar_state_free(st);
    moe_grammar_free(g);
    gs = "root ::= a*\na ::= \"x\" | \"x\" \"x\" a \"y\"";
    g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    CHECK(g != NULL);
    st = moe_grammar_state_new(g, err, sizeof err);
    rc = 1;
    for (i = 0; i < 5000 && rc == 1; i++)
        rc = moe_grammar_state_accept_bytes(st, "x", 1);
    CHECK(rc == -1); /* stacks a y, a y y, ...: the depth or the stack cap stops it */
    CHECK(moe_grammar_state_error(st)[0] != '\0');
    moe_grammar_state_free(st);
    moe_grammar_free(g);
}

/* ---------------------------------------------------------------- mask */

TEST(grammar_mask_equals_brute_force)
{
    moe_test_rng_seed(11);
    struct gt_vocab tv;
    gt_vocab_synthetic(&tv, 3000);
    char err[256];
    struct moe_grammar_vocab *v = moe_grammar_vocab_new((const char *const *)tv.tok, tv.len, tv.n,
                                                        tv.eog, err, sizeof err);
    CHECK_MSG(v != NULL, "%s", err);
    static const char *grammars[] = {
        "root ::= \"{\" ws \"\\\"\" [a-z]* \"\\\"\" ws \":\" ws [0-9]+ ws \"}\"\nws ::= [ ]?",
        "root ::= ([a-zé€] | \"😀\" | \" \")* \".\"",
        "root ::= [^a]{2,5}",
        "root ::= (\"ab\" | \"abc\" | \"b\")+",
        "root ::= \"\\\"\" ( [^\"\\\\] | \"\\\\\" [\"\\\\nt] )* \"\\\"\"",
    };
    static const char *prefixes[] = {"", "{", "{ \"ab", "{\"x\":1", "ab", "\"\xe2\x82", "\"é", "x"};
    uint8_t *mask = malloc(tv.n);
    for (size_t gi = 0; gi < sizeof grammars / sizeof *grammars; gi++) {
        struct moe_grammar *g = moe_grammar_parse(grammars[gi], strlen(grammars[gi]), err,
                                                  sizeof err);
        CHECK_MSG(g != NULL, "%s", err);
        for (size_t pi = 0; pi < sizeof prefixes / sizeof *prefixes; pi++) {
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            if (moe_grammar_state_accept_bytes(st, prefixes[pi], strlen(prefixes[pi])) != 1) {
                moe_grammar_state_free(st);
                continue;
            }
            moe_grammar_state_set_mask_cache(st, (uint32_t)(pi % 3) * 8); /* 0, 8, 16 */
            if (pi == 0)
                moe_grammar_state_set_mask_cache(st, MOE_GRAMMAR_MASK_CACHE_NODES);
            long allowed = moe_grammar_mask(st, v, mask);
            CHECK(allowed >= 0);
            long count = 0;
            for (uint32_t t = 0; t < tv.n; t++) {
                int want;
                if (tv.eog[t]) {
                    want = moe_grammar_state_is_accepting(st);
                } else if (tv.len[t] == 0) {
                    want = 0;
                } else {
                    struct moe_grammar_state *c = moe_grammar_state_clone(st);
                    want = moe_grammar_state_accept_bytes(c, tv.tok[t], tv.len[t]) == 1;
                    moe_grammar_state_free(c);
                }
                CHECK_MSG(mask[t] == want, "grammar %zu prefix '%s' token %u ('%.*s'): mask %d",
                          gi, prefixes[pi], t, (int)tv.len[t], tv.tok[t], mask[t]);
                count += want;
            }
            CHECK_EQ(allowed, count);
            moe_grammar_state_free(st);
        }
        moe_grammar_free(g);
    }
    free(mask);
    moe_grammar_vocab_free(v);
    gt_vocab_free(&tv);
}

/* Mutations of valid grammars: the parser and the matcher must fail cleanly or work. */
TEST(grammar_mini_fuzz)
{
    static const char *seeds[] = {
        ("root ::= \"{\" ws (pair (\",\" ws pair)*)? \"}\"\npair ::= [a-z]+ \":\" ws [0-9]{1,3}\n"
         "ws ::= [ \\t\\n]{0,4}\n"),
        "root ::= (\"a\" | [b-d] | \"\\u00e9\")* \"e\"+ \"f\"? \"g\"{2} \"h\"{1,} # c\n",
        "root ::= x\nx ::= \"(\" x \")\" | [^()]\n",
        "root ::= [\\x00-\\x1f\\]\\[\\-]{1,3} . (\"\\U0001F600\" | \"\\\"\")\n",
    };
    static const char alphabet[] = "\"[]()|*+?{},:=# \n\\-^.ax09é";
    moe_test_rng_seed(7);
    char err[256];
    uint8_t mask[64];
    struct gt_vocab tv;
    gt_vocab_synthetic(&tv, 64);
    struct moe_grammar_vocab *v = moe_grammar_vocab_new((const char *const *)tv.tok, tv.len, tv.n,
                                                        tv.eog, err, sizeof err);
    int parsed = 0;
    for (int iter = 0; iter < 20000; iter++) {
        const char *seed = seeds[moe_test_rng_u32() % (sizeof seeds / sizeof *seeds)];
        size_t n = strlen(seed);
        char *buf = malloc(n + 64);
        memcpy(buf, seed, n);
        int muts = 1 + (int)(moe_test_rng_u32() % 4);
        for (int m = 0; m < muts; m++) {
            uint32_t op = moe_test_rng_u32() % 4, at = n ? moe_test_rng_u32() % (uint32_t)n : 0;
            char c = alphabet[moe_test_rng_u32() % (sizeof alphabet - 1)];
            if (op == 0 && n) {
                buf[at] = c;
            } else if (op == 1 && n + 1 < 64 + strlen(seed)) {
                memmove(buf + at + 1, buf + at, n - at);
                buf[at] = c;
                n++;
            } else if (op == 2 && n) {
                memmove(buf + at, buf + at + 1, n - at - 1);
                n--;
            } else if (n) {
                buf[at] = (char)(moe_test_rng_u32() & 0xff);
            }
        }
        char *exact = malloc(n ? n : 1); /* exact size: reading past the end would be seen */
        memcpy(exact, buf, n);
        free(buf);
        err[0] = '\0';
        struct moe_grammar *g = moe_grammar_parse(exact, n, err, sizeof err);
        if (!g) {
            CHECK(err[0] != '\0');
        } else {
            parsed++;
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            for (int k = 0; st && k < 8; k++) {
                if (moe_grammar_mask(st, v, mask) <= 0)
                    break;
                uint32_t t = moe_test_rng_u32() % tv.n, tries = 0;
                while ((!mask[t] || tv.eog[t]) && tries++ < tv.n)
                    t = (t + 1) % tv.n;
                if (!mask[t] || tv.eog[t])
                    break;
                CHECK_EQ(moe_grammar_state_accept_bytes(st, tv.tok[t], tv.len[t]), 1);
            }
            moe_grammar_state_free(st);
            moe_grammar_free(g);
        }
        free(exact);
    }
    CHECK(parsed > 100);
    moe_grammar_vocab_free(v);
    gt_vocab_free(&tv);
}

/* Points of the output to time the mask at, each also checked token by token against feeding
 * every token to a clone of the state. */
struct mask_point {
    const char *what, *prefix;
};

static const struct mask_point object_points[] = {
    {"start of an object", ""},
    {"after '{'", "{"},
    {"inside a key", "{\"na"},
    {"after a key", "{\"name\""},
    {"inside a string value", "{\"name\": \"Jo"},
    {"inside a number", "{\"n\": 12"},
    {"after a value", "{\"n\": 12, \"a\": [true"},
    {"inside a UTF-8 character", "{\"k\": \"\xe6\x97"},
};

static const char *mask_schema =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":40},"
    "\"kind\":{\"enum\":[\"person\",\"company\",\"other\"]},\"age\":{\"type\":\"integer\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":8},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},"
    "\"id\":{\"type\":\"string\",\"format\":\"uuid\"}},\"required\":[\"city\"]}},"
    "\"required\":[\"name\",\"kind\"],\"additionalProperties\":{\"type\":\"boolean\"}}";

static const struct mask_point schema_points[] = {
    {"start", ""},
    {"after '{'", "{"},
    {"inside maxLength 40 string", "{\"name\": \"Jo"},
    {"after the first value", "{\"name\": \"Jo\", "},
    {"inside an enum", "{\"name\": \"Jo\", \"kind\": \"pe"},
    {"inside an extra key", "{\"name\":\"x\",\"kind\":\"other\",\"zz"},
    {"inside the tags array", "{\"name\":\"x\",\"kind\":\"other\",\"tags\":[\"a\","},
    {"inside a uuid", "{\"name\":\"x\",\"kind\":\"other\",\"address\":{\"city\":\"P\",\"id\":\"12"},
};

static void time_points(const struct gt_vocab *tv, const struct moe_grammar_vocab *v,
                        const char *gs, const struct mask_point *pts, size_t n_points)
{
    char err[512];
    struct moe_grammar *g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    CHECK_MSG(g != NULL, "%s", err);
    uint8_t *mask = malloc(tv->n);
    double total = 0;
    for (size_t i = 0; i < n_points; i++) {
        struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
        CHECK_MSG(moe_grammar_state_accept_bytes(st, pts[i].prefix, strlen(pts[i].prefix)) == 1,
                  "%s", pts[i].what);
        int reps = 5;
        long allowed = 0;
        double t0 = moe_test_now();
        for (int r = 0; r < reps; r++)
            allowed = moe_grammar_mask(st, v, mask);
        double ms = (moe_test_now() - t0) * 1e3 / reps;
        total += ms;
        CHECK(allowed > 0);
        fprintf(stderr, "  mask %-28s %7.2f ms  %6ld tokens allowed\n", pts[i].what, ms, allowed);
        /* the same mask without the step cache, and with one that runs out along the way */
        static const uint32_t cache_sizes[] = {0, 64};
        uint8_t *m2 = malloc(tv->n);
        for (size_t k = 0; k < sizeof cache_sizes / sizeof *cache_sizes; k++) {
            struct moe_grammar_state *c2 = moe_grammar_state_clone(st);
            moe_grammar_state_set_mask_cache(c2, cache_sizes[k]);
            CHECK_EQ(moe_grammar_mask(c2, v, m2), allowed);
            CHECK_MSG(memcmp(m2, mask, tv->n) == 0, "%s: cache %u differs", pts[i].what,
                      cache_sizes[k]);
            moe_grammar_state_free(c2);
        }
        free(m2);
        for (uint32_t t = 0; t < tv->n; t++) {
            int want = 0;
            if (tv->eog[t]) {
                want = moe_grammar_state_is_accepting(st);
            } else if (tv->len[t]) {
                struct moe_grammar_state *c = moe_grammar_state_clone(st);
                want = moe_grammar_state_accept_bytes(c, tv->tok[t], tv->len[t]) == 1;
                moe_grammar_state_free(c);
            }
            CHECK_MSG(mask[t] == want, "%s: token %u ('%.*s') mask %d", pts[i].what, t,
                      (int)tv->len[t], tv->tok[t], mask[t]);
        }
        moe_grammar_state_free(st);
    }
    fprintf(stderr, "  mean %.2f ms per mask\n", total / (double)n_points);
    free(mask);
    moe_grammar_free(g);
}

/* Builds the vocabulary and times the mask with the json_object grammar and a schema's. */
static void mask_time_and_check(const struct gt_vocab *tv, const char *label)
{
    char err[512];
    double t0 = moe_test_now();
    struct moe_grammar_vocab *v = moe_grammar_vocab_new((const char *const *)tv->tok, tv->len,
                                                        tv->n, tv->eog, err, sizeof err);
    CHECK_MSG(v != NULL, "%s", err);
    fprintf(stderr, "%s: %u tokens, %u trie nodes, built in %.1f ms\njson_object grammar:\n",
            label, tv->n, moe_grammar_vocab_n_nodes(v), (moe_test_now() - t0) * 1e3);
    time_points(tv, v, gt_json_object_gbnf(), object_points,
                sizeof object_points / sizeof *object_points);
    json_error_t je;
    json_t *schema = json_loads(mask_schema, 0, &je);
    CHECK_MSG(schema != NULL, "%s", je.text);
    char *gbnf;
    CHECK_MSG(moe_json_schema_to_gbnf(schema, &gbnf, err, sizeof err) == 0, "%s", err);
    fprintf(stderr, "schema grammar:\n");
    time_points(tv, v, gbnf, schema_points, sizeof schema_points / sizeof *schema_points);
    free(gbnf);
    json_decref(schema);
    moe_grammar_vocab_free(v);
}

/* Mask time on a synthetic 151,936-token vocabulary (Qwen3's size), printed with -v. */
TEST_TIMEOUT(grammar_mask_synthetic_vocab, 300)
{
    moe_test_rng_seed(3);
    struct gt_vocab tv;
    gt_vocab_synthetic(&tv, 151936);
    mask_time_and_check(&tv, "synthetic vocab");
    gt_vocab_free(&tv);
}

/* The real Qwen3 vocabulary (tests/golden): token bytes through the tokenizer, control tokens
 * never allowed (no bytes), end-of-generation ones when accepting. */
TEST_TIMEOUT(grammar_mask_qwen3_vocab, 300)
{
    const char *path = "tests/golden/tokenizer/qwen3-vocab.gguf";
    char err[512] = "";
    struct gguf_file *f = NULL;
    CHECK_MSG(gguf_open(&f, path, err, sizeof err) == 0, "%s: %s", path, err);
    struct moe_tokenizer *tok = NULL;
    CHECK_MSG(moe_tok_load(&tok, f, err, sizeof err) == 0, "%s", err);
    gguf_close(f);
    uint32_t n = moe_tok_n_vocab(tok);
    CHECK_EQ(n, 151936);
    struct gt_vocab tv = {calloc(n, sizeof(char *)), calloc(n, sizeof(uint32_t)), calloc(n, 1), n};
    char buf[4096];
    for (uint32_t i = 0; i < n; i++) {
        int len = moe_tok_piece(tok, (int32_t)i, buf, sizeof buf);
        CHECK(len >= 0 && len <= (int)sizeof buf);
        tv.eog[i] = moe_tok_is_eog(tok, (int32_t)i);
        if (moe_tok_is_control(tok, (int32_t)i) && !tv.eog[i])
            len = 0;
        gt_vocab_set(&tv, i, buf, (size_t)len);
    }
    moe_tok_free(tok);
    mask_time_and_check(&tv, "qwen3 vocab");
    gt_vocab_free(&tv);
}

/* JSON Schema to GBNF (store/json_schema.c), checked through the matcher: the documents of
 * tests/fixtures/grammar/schemas.json (expectations checked against the jsonschema package by
 * tools/grammar-fixtures.py), refused schemas, and random generation under the token mask. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <math.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/grammar_test.h"
#include "tests/harness.h"

#define FIXTURE "tests/fixtures/grammar/schemas.json"

static json_t *load_fixture(void)
{
    json_error_t je;
    json_t *f = json_load_file(FIXTURE, 0, &je);
    CHECK_MSG(f != NULL, "%s:%d: %s", FIXTURE, je.line, je.text);
    return f;
}

static struct moe_grammar *schema_grammar(json_t *schema, const char *name)
{
    char err[512], *gbnf = NULL;
    int rc = moe_json_schema_to_gbnf(schema, &gbnf, err, sizeof err);
    CHECK_MSG(rc == 0, "%s: %s", name, err);
    struct moe_grammar *g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
    CHECK_MSG(g != NULL, "%s: %s\n%s", name, err, gbnf);
    free(gbnf);
    return g;
}

TEST(grammar_schema_documents)
{
    json_t *f = load_fixture();
    json_t *cases = json_object_get(f, "cases"), *c;
    size_t i, n_docs = 0;
    CHECK(json_array_size(cases) >= 30);
    json_array_foreach(cases, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        struct moe_grammar *g = schema_grammar(json_object_get(c, "schema"), name);
        size_t j;
        json_t *d;
        json_array_foreach(json_object_get(c, "valid"), j, d) {
            CHECK_MSG(gt_match(g, json_string_value(d)) == 1, "%s: should accept %s", name,
                      json_string_value(d));
            n_docs++;
        }
        json_array_foreach(json_object_get(c, "invalid"), j, d) {
            CHECK_MSG(gt_match(g, json_string_value(d)) == 0, "%s: should reject %s", name,
                      json_string_value(d));
            n_docs++;
        }
        moe_grammar_free(g);
    }
    fprintf(stderr, "%zu schemas, %zu documents\n", json_array_size(cases), n_docs);
    json_decref(f);
}

TEST(grammar_schema_refusals_name_the_keyword)
{
    json_t *f = load_fixture();
    json_t *errors = json_object_get(f, "errors"), *e;
    size_t i;
    CHECK(json_array_size(errors) >= 10);
    json_array_foreach(errors, i, e) {
        char err[512], *gbnf = (char *)"unset";
        int rc = moe_json_schema_to_gbnf(json_object_get(e, "schema"), &gbnf, err, sizeof err);
        const char *want = json_string_value(json_object_get(e, "error"));
        CHECK_MSG(rc == -1 && gbnf == NULL, "schema %zu converted", i);
        CHECK_MSG(strstr(err, want) != NULL, "schema %zu: '%s' lacks '%s'", i, err, want);
    }
    json_decref(f);
}

TEST(grammar_json_object_grammar)
{
    const char *gs = moe_json_object_gbnf();
    char err[256];
    struct moe_grammar *g = moe_grammar_parse(gs, strlen(gs), err, sizeof err);
    CHECK_MSG(g != NULL, "%s", err);
    static const char *yes[] = {"{}", "{\"a\": 1}", "{\"a\":[1,2.5e-3,{\"b\":null}],\"c\":\"é\"}",
                                "{\n  \"k\": true,\n  \"l\": false\n}\n"};
    static const char *no[] = {"[]", "\"s\"", "1", "{", "{\"a\"}", "{\"a\":1,}", "{'a':1}",
                               "{\"a\":01}", "{} {}"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        CHECK_MSG(gt_match(g, yes[i]) == 1, "should accept %s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++)
        CHECK_MSG(gt_match(g, no[i]) == 0, "should reject %s", no[i]);
    moe_grammar_free(g);
}

TEST(grammar_schema_deep_recursion_and_limits)
{
    /* a deeply nested document of a recursive schema stays within the state's limits */
    json_error_t je;
    json_t *s = json_loads("{\"$defs\":{\"l\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/l\"}}},"
                           "\"$ref\":\"#/$defs/l\"}",
                           0, &je);
    CHECK(s != NULL);
    struct moe_grammar *g = schema_grammar(s, "nested lists");
    char doc[2 * 200 + 1];
    for (int i = 0; i < 200; i++) {
        doc[i] = '[';
        doc[200 + i] = ']';
    }
    doc[400] = '\0';
    CHECK_EQ(gt_match(g, doc), 1);
    doc[399] = '\0';
    CHECK_EQ(gt_match(g, doc), 0);
    moe_grammar_free(g);
    json_decref(s);
    /* schemas nested past the converter's depth are refused */
    char buf[64 * 16 + 64];
    size_t n = 0;
    for (int i = 0; i < 70; i++)
        n += (size_t)sprintf(buf + n, "{\"items\":");
    n += (size_t)sprintf(buf + n, "{}");
    for (int i = 0; i < 70; i++)
        buf[n++] = '}';
    buf[n] = '\0';
    s = json_loads(buf, 0, &je);
    CHECK(s != NULL);
    char err[256], *gbnf;
    CHECK_EQ(moe_json_schema_to_gbnf(s, &gbnf, err, sizeof err), -1);
    CHECK_MSG(strstr(err, "nested deeper") != NULL, "%s", err);
    json_decref(s);
}

/* ---------------------------------------------------------------- numeric bounds */

/* The value of a JSON number, exact for integers of 16 digits (a long double holds 64 bits). */
static long double num_value(json_t *v)
{
    return json_is_integer(v) ? (long double)json_integer_value(v) : json_real_value(v);
}

/* Whether x is within the bounds of s (the bound keywords, as JSON Schema reads them); cmp(x, v)
 * is the sign of x - v for a bound v. */
static int bounds_hold(json_t *s, int (*cmp)(const void *, json_t *), const void *x)
{
    json_t *v;
    if ((v = json_object_get(s, "minimum")) && cmp(x, v) < 0)
        return 0;
    if ((v = json_object_get(s, "maximum")) && cmp(x, v) > 0)
        return 0;
    if ((v = json_object_get(s, "exclusiveMinimum")) && cmp(x, v) <= 0)
        return 0;
    if ((v = json_object_get(s, "exclusiveMaximum")) && cmp(x, v) >= 0)
        return 0;
    return 1;
}

static int cmp_long_double(const void *x, json_t *v)
{
    long double a = *(const long double *)x, b = num_value(v);
    return (a > b) - (a < b);
}

static int in_bounds(json_t *s, long double x)
{
    return bounds_hold(s, cmp_long_double, &x);
}

/* A random bound: an integer near 0, near a power of ten, or (for half of them) with .5; for a
 * number (non-whole), half of those with k / 65536 instead, of up to 16 fraction digits. */
static json_t *random_bound(int fractional, int number)
{
    static const long long near[] = {0, 1, 9, 10, 99, 100, 999, 1000, 9999999999999999LL};
    long long v = (long long)(moe_test_rng_u32() % 2400) - 1200;
    if (moe_test_rng_u32() % 3 == 0)
        v = near[moe_test_rng_u32() % (sizeof near / sizeof *near)] +
            (long long)(moe_test_rng_u32() % 5) - 2;
    if (number && moe_test_rng_u32() % 8 == 0)
        v = 4503599627370495LL - (long long)(moe_test_rng_u32() % 3); /* 2^52 - 1: .5 is exact */
    if (moe_test_rng_u32() % 2)
        v = -v;
    if (!fractional || moe_test_rng_u32() % 2)
        return json_integer(v);
    if (!number || llabs(v) > 100000 || moe_test_rng_u32() % 2)
        return json_real((double)v + (v < 0 ? -0.5 : 0.5));
    /* k / 65536: 1 to 16 fraction digits, by how many factors of 2 k has */
    unsigned k = (moe_test_rng_u32() % 65535 + 1) >> (moe_test_rng_u32() % 16);
    if (!k)
        k = 1;
    double f = (double)k / 65536.0;
    return json_real((double)v + (v < 0 || (v == 0 && moe_test_rng_u32() % 2) ? -f : f));
}

/* Decimal values with up to 16 fraction digits, exactly: the value times 10^16. */
typedef __int128 scaled_t;
#define SCALE 10000000000000000LL

/* A bound as a scaled value: integers, and reals of up to 16 binary fraction digits. */
static scaled_t bound_scaled(json_t *v)
{
    if (json_is_integer(v))
        return (scaled_t)json_integer_value(v) * SCALE;
    double d = json_real_value(v), ip = trunc(d);
    long long k = llround((d - ip) * 65536.0); /* exact: bounds are k / 65536 past a whole */
    return (scaled_t)(long long)ip * SCALE + (scaled_t)k * (SCALE / 65536);
}

static int cmp_scaled(const void *x, json_t *v)
{
    scaled_t a = *(const scaled_t *)x, b = bound_scaled(v);
    return (a > b) - (a < b);
}

static int in_bounds_scaled(json_t *s, scaled_t x)
{
    return bounds_hold(s, cmp_scaled, &x);
}

/* x as JSON: all 16 fraction digits (trailing zeros included) when full, else the fewest. */
static void scaled_text(char *t, size_t n, scaled_t x, int full)
{
    scaled_t m = x < 0 ? -x : x;
    int k = snprintf(t, n, "%s%lld.%016lld", x < 0 ? "-" : "", (long long)(m / SCALE),
                     (long long)(m % SCALE));
    while (!full && t[k - 1] == '0')
        t[--k] = '\0';
    if (t[k - 1] == '.')
        t[k - 1] = '\0';
}

TEST_TIMEOUT(grammar_schema_numeric_bounds, 300)
{
    moe_test_rng_seed(11);
    static const char *keys[] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    int checked = 0, refused = 0;
    for (int iter = 0; iter < 300; iter++) {
        int integer = iter % 2 == 0;
        json_t *s = json_pack("{ss}", "type", integer ? "integer" : "number");
        int nb = 0;
        for (int k = 0; k < 4; k++)
            if (moe_test_rng_u32() % 3 == 0) {
                json_object_set_new(s, keys[k], random_bound(1, !integer));
                nb++;
            }
        if (!nb)
            json_object_set_new(s, keys[moe_test_rng_u32() % 4], random_bound(1, !integer));
        char err[512], *gbnf = NULL;
        if (moe_json_schema_to_gbnf(s, &gbnf, err, sizeof err) != 0) {
            /* only an empty range is refused */
            int any = 0;
            for (long long x = -1300; x <= 1300 && !any; x++)
                any = in_bounds(s, (long double)x) || (!integer && in_bounds(s, x + 0.25L));
            for (int k = 0; k < 4 && !integer; k++) /* a bound of 16 digits, or 10^-16 past it */
                for (int d = -1; d <= 1 && json_object_get(s, keys[k]); d++) {
                    scaled_t x = bound_scaled(json_object_get(s, keys[k])) + d;
                    any = any || (x < (scaled_t)SCALE * SCALE && x > -(scaled_t)SCALE * SCALE &&
                                  in_bounds_scaled(s, x));
                }
            char *t = json_dumps(s, JSON_COMPACT);
            CHECK_MSG(!any && strstr(err, "satisfies the bounds"), "%s refused: %s", t, err);
            free(t);
            refused++;
            json_decref(s);
            continue;
        }
        struct moe_grammar *g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
        CHECK_MSG(g != NULL, "%s\n%s", err, gbnf);
        long long centres[] = {0, 1000, -1000, 9999999999999999LL, -9999999999999999LL};
        for (size_t ci = 0; ci < sizeof centres / sizeof *centres; ci++) {
            for (long long x = centres[ci] - 1300; x <= centres[ci] + 1300; x++) {
                if (x > 9999999999999999LL || x < -9999999999999999LL)
                    continue;
                if (ci && (x % 7) && llabs(x - centres[ci]) > 20)
                    continue;
                char t[64];
                snprintf(t, sizeof t, "%lld", x);
                int want = in_bounds(s, (long double)x);
                CHECK_MSG(gt_match(g, t) == want, "%s: %s\n%s", t, want ? "rejected" : "accepted",
                          gbnf);
                if (integer) {
                    snprintf(t, sizeof t, "%lld.5", x);
                    CHECK(gt_match(g, t) == 0);
                    continue;
                }
                snprintf(t, sizeof t, "%lld.000", x);
                CHECK_MSG(gt_match(g, t) == want, "%s\n%s", t, gbnf);
                /* x + 0.25 and x - 0.25, written from the magnitude */
                for (int sg = -1; sg <= 1; sg += 2) {
                    long double y = (long double)x + sg * 0.25L;
                    long double m = y < 0 ? -y : y;
                    long long ip = (long long)m;
                    snprintf(t, sizeof t, "%s%lld.%s", y < 0 ? "-" : "", ip,
                             m - (long double)ip == 0.75L ? "75" : "25");
                    CHECK_MSG(gt_match(g, t) == in_bounds(s, y), "%s\n%s", t, gbnf);
                }
                /* the smallest fraction of 16 digits off an integer */
                if (llabs(x) < 100) {
                    snprintf(t, sizeof t, "%lld.0000000000000001", x);
                    long double y = (long double)x + (x < 0 || t[0] == '-' ? -1e-16L : 1e-16L);
                    CHECK_MSG(gt_match(g, t) == in_bounds(s, y), "%s\n%s", t, gbnf);
                }
            }
        }
        /* a number: at each bound, the bound itself (with and without trailing zeros) and the
         * values 10^-16, 10^-8 and 1 either side */
        for (int k = 0; k < 4 && !integer; k++) {
            json_t *v = json_object_get(s, keys[k]);
            if (!v)
                continue;
            static const long long steps[] = {0, 1, -1, 100000000, -100000000, SCALE, -SCALE};
            for (size_t si = 0; si < sizeof steps / sizeof *steps; si++) {
                scaled_t x = bound_scaled(v) + steps[si];
                if (x >= (scaled_t)SCALE * SCALE || x <= -(scaled_t)SCALE * SCALE)
                    continue;
                for (int full = 0; full <= 1; full++) {
                    char t[64];
                    scaled_text(t, sizeof t, x, full);
                    int want = in_bounds_scaled(s, x);
                    CHECK_MSG(gt_match(g, t) == want, "%s: %s\n%s", t,
                              want ? "rejected" : "accepted", gbnf);
                }
            }
        }
        if (in_bounds(s, 0)) {
            CHECK(gt_match(g, "-0") == 1);
            CHECK(gt_match(g, "0") == 1);
        }
        static const char *bad[] = {"00", "01", "-", "1e3", "+1", "1.", ".5", "-01", "1 1"};
        for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
            CHECK_MSG(gt_match(g, bad[i]) == 0, "accepted %s\n%s", bad[i], gbnf);
        CHECK_MSG(moe_grammar_n_rules(g) < 400, "%u rules\n%s", moe_grammar_n_rules(g), gbnf);
        moe_grammar_free(g);
        free(gbnf);
        json_decref(s);
        checked++;
    }
    fprintf(stderr, "%d bounded schemas checked, %d refused as empty\n", checked, refused);
    CHECK(checked > 200);
}

/* ---------------------------------------------------------------- pattern */

/* Whether pattern finds a match in s (n bytes), by PCRE2: ECMA-262 syntax for what the converter
 * takes; ucp: Unicode \d \w \s (wider than ECMA-262's, for checking what a grammar allows). */
static int pcre_search(const char *pattern, const char *s, size_t n, int ucp)
{
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_DOLLAR_ENDONLY | PCRE2_ALT_BSUX |
                                       (ucp ? PCRE2_UCP : 0),
                                   &ec, &eo, NULL);
    CHECK_MSG(re != NULL, "pcre2 refuses %s", pattern);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc >= 0;
}

TEST(grammar_schema_pattern_against_pcre)
{
    static const char *pats[] = {
        "^a*b$", "ab", "a|b", "^(a|bc)+$", "[^a-c]", "^[\\d\\s]*$", "^.{2}$", "a.c", "\\\\",
        "\"", "^[\"\\\\]+$", "^\\t?x?$", "^(?:ab|a)(?:c|bc)$", "^a{2,3}$", "a{2}", "^[^\"]*$",
        "\\w+-\\w", "^é+😀?$", "^[a-cé-ë]$", "^(a(b(c)?)?)?$", "^.*$", "x*", "^$", "^(a|)b$",
        "\\u0001", "^[\\x00-\\x1f]$", "^(?<g>a)b?$", "1$|^9", "^[.]\\.$", "[-a]", "^a+?$",
        "^[^\\D5]\\W$", "^\\S\\s", "c{1,}$", "^(ab){0,2}$", "^\\x41?\\cA?$", "^[\\b]?é$"};
    static const char *alpha[] = {"a", "b", "c", "1", "9", "5", "\"", "\\", "\n", "\t", " ",
                                  "é", "ë", "😀", "-", ".", "A", "_", "x", "\x01", "\b"};
    moe_test_rng_seed(3);
    int n_match = 0, n_checked = 0;
    for (size_t pi = 0; pi < sizeof pats / sizeof *pats; pi++) {
        json_t *s = json_pack("{ssss}", "type", "string", "pattern", pats[pi]);
        struct moe_grammar *g = schema_grammar(s, pats[pi]);
        for (int k = 0; k < 2000; k++) {
            char text[64];
            size_t n = 0;
            int len = (int)(moe_test_rng_u32() % 6);
            for (int i = 0; i < len; i++) {
                const char *a = alpha[moe_test_rng_u32() % (sizeof alpha / sizeof *alpha)];
                memcpy(text + n, a, strlen(a));
                n += strlen(a);
            }
            json_t *js = json_stringn(text, n);
            char *doc = json_dumps(js, JSON_ENCODE_ANY);
            int want = pcre_search(pats[pi], text, n, 0);
            CHECK_MSG(gt_match(g, doc) == want, "%s: %s %s", pats[pi], doc,
                      want ? "rejected" : "accepted");
            n_match += want;
            n_checked++;
            free(doc);
            json_decref(js);
        }
        moe_grammar_free(g);
        json_decref(s);
    }
    fprintf(stderr, "%d strings checked against PCRE2, %d matching\n", n_checked, n_match);
}

TEST(grammar_schema_pattern_limits)
{
    /* long or repetitive patterns are refused or stay within the grammar's limits */
    static const char *pats[] = {"(((((((((((((((((((((((((((((((((a)))))))))))))))))))))))))))))))))",
                                 "(a{1000}){1000}", "((a|b){1000}c){3}", "[^\\s\\S]",
                                 "(x+x+)+y", "(.*){1,1000}", "(a?){1000}b"};
    for (size_t i = 0; i < sizeof pats / sizeof *pats; i++) {
        json_t *s = json_pack("{ssss}", "type", "string", "pattern", pats[i]);
        char err[512], *gbnf = NULL;
        if (moe_json_schema_to_gbnf(s, &gbnf, err, sizeof err) == 0) {
            struct moe_grammar *g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
            CHECK_MSG(g != NULL, "%s: %s", pats[i], err);
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            CHECK(st != NULL);
            const char *doc = "\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxy\"";
            for (const char *p = doc; *p; p++)
                if (moe_grammar_state_accept_bytes(st, p, 1) != 1)
                    break;
            moe_grammar_state_free(st);
            moe_grammar_free(g);
            free(gbnf);
        } else {
            CHECK_MSG(strstr(err, "pattern") != NULL, "%s: %s", pats[i], err);
        }
        json_decref(s);
    }
    /* short patterns on many properties fit: only groups and repetitions count */
    json_t *props = json_object();
    for (int i = 0; i < 300; i++) {
        char key[16], pat[64];
        snprintf(key, sizeof key, "p%d", i);
        snprintf(pat, sizeof pat, "^[a-z]+-(\\d{2}|x)$|^%d$", i);
        json_object_set_new(props, key, json_pack("{ssss}", "type", "string", "pattern", pat));
    }
    json_t *obj = json_pack("{ssso}", "type", "object", "properties", props);
    struct moe_grammar *g = schema_grammar(obj, "300 patterns");
    CHECK(gt_match(g, "{\"p0\": \"ab-12\", \"p7\": \"7\"}") == 1);
    CHECK(gt_match(g, "{\"p0\": \"ab-1\"}") == 0);
    moe_grammar_free(g);
    json_decref(obj);
    char big[4096];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    json_t *s = json_pack("{ssss}", "type", "string", "pattern", big);
    char err[512], *gbnf = NULL;
    CHECK_EQ(moe_json_schema_to_gbnf(s, &gbnf, err, sizeof err), -1);
    CHECK_MSG(strstr(err, "longer than") != NULL, "%s", err);
    json_decref(s);
}

/* ---------------------------------------------------------------- random generation */

static json_t *resolve_ref(json_t *root, const char *ref)
{
    if (strcmp(ref, "#") == 0)
        return root;
    static const char *sect[] = {"$defs", "definitions"};
    for (int i = 0; i < 2; i++) {
        size_t n = strlen(sect[i]);
        if (strncmp(ref, "#/", 2) == 0 && strncmp(ref + 2, sect[i], n) == 0 && ref[2 + n] == '/')
            return json_object_get(json_object_get(root, sect[i]), ref + 3 + n);
    }
    return NULL;
}

static size_t utf8_len(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xc0) != 0x80;
    return n;
}

static int type_ok(const char *t, json_t *d)
{
    if (strcmp(t, "string") == 0)
        return json_is_string(d);
    if (strcmp(t, "integer") == 0)
        return json_is_integer(d);
    if (strcmp(t, "number") == 0)
        return json_is_number(d);
    if (strcmp(t, "boolean") == 0)
        return json_is_boolean(d);
    if (strcmp(t, "null") == 0)
        return json_is_null(d);
    if (strcmp(t, "array") == 0)
        return json_is_array(d);
    if (strcmp(t, "object") == 0)
        return json_is_object(d);
    return 0;
}

/* The shape the grammar promises: types, enum/const, properties (required, no others unless
 * additionalProperties allows), items (prefixItems too) and their counts, string lengths,
 * numeric bounds, patterns (by PCRE2), anyOf/oneOf/allOf, $ref. Formats are not checked. */
static int shape_ok_x(json_t *root, json_t *s, json_t *d, int extra_ok);

static int shape_ok(json_t *root, json_t *s, json_t *d) { return shape_ok_x(root, s, d, 0); }

/* extra_ok: keys beyond the properties are allowed (inside allOf) */
static int shape_ok_x(json_t *root, json_t *s, json_t *d, int extra_ok)
{
    if (json_is_true(s))
        return 1;
    json_t *v;
    if ((v = json_object_get(s, "$ref")))
        return shape_ok(root, resolve_ref(root, json_string_value(v)), d);
    if ((v = json_object_get(s, "const")))
        return json_equal(v, d);
    size_t i;
    json_t *x;
    if ((v = json_object_get(s, "enum"))) {
        json_array_foreach(v, i, x) if (json_equal(x, d)) return 1;
        return 0;
    }
    if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        json_array_foreach(v, i, x) if (shape_ok(root, x, d)) return 1;
        return 0;
    }
    if ((v = json_object_get(s, "allOf"))) {
        json_array_foreach(v, i, x) if (!shape_ok_x(root, x, d, 1)) return 0;
    }
    if (json_is_null(d) && json_is_true(json_object_get(s, "nullable")))
        return 1;
    if ((v = json_object_get(s, "type"))) {
        int ok = 0;
        if (json_is_string(v))
            ok = type_ok(json_string_value(v), d);
        json_array_foreach(v, i, x) ok |= type_ok(json_string_value(x), d);
        if (!ok)
            return 0;
    }
    if (json_is_object(d)) {
        json_t *props = json_object_get(s, "properties"), *addl;
        addl = json_object_get(s, "additionalProperties");
        json_array_foreach(json_object_get(s, "required"), i, x)
            if (!json_object_get(d, json_string_value(x))) return 0;
        const char *k;
        json_object_foreach(d, k, x) {
            json_t *ps = json_object_get(props, k);
            if (ps) {
                if (!shape_ok(root, ps, x))
                    return 0;
            } else if (!extra_ok && (json_is_false(addl) || (!addl && props))) {
                return 0;
            } else if (json_is_object(addl) && !shape_ok(root, addl, x)) {
                return 0;
            }
        }
    }
    if (json_is_array(d)) {
        json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
        json_array_foreach(d, i, x) {
            json_t *is = i < json_array_size(prefix) ? json_array_get(prefix, i) : items;
            if (json_is_false(is) || (is && !shape_ok(root, is, x)))
                return 0;
        }
        json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
        if (mn && json_array_size(d) < (size_t)json_integer_value(mn))
            return 0;
        if (mx && json_array_size(d) > (size_t)json_integer_value(mx))
            return 0;
    }
    if (json_is_number(d) && !in_bounds(s, num_value(d)))
        return 0;
    if (json_is_string(d) && json_is_string(v = json_object_get(s, "pattern")) &&
        !pcre_search(json_string_value(v), json_string_value(d), json_string_length(d), 1))
        return 0;
    if (json_is_string(d)) {
        size_t n = utf8_len(json_string_value(d));
        json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
        if (mn && n < (size_t)json_integer_value(mn))
            return 0;
        if (mx && n > (size_t)json_integer_value(mx))
            return 0;
    }
    return 1;
}

struct gen_vocab {
    char *tok[768];
    uint32_t len[768];
    uint8_t eog[768];
    uint32_t n;
};

static void gv_add(struct gen_vocab *v, const char *s)
{
    if (v->n >= 767)
        return;
    for (uint32_t i = 0; i < v->n; i++)
        if (strcmp(v->tok[i], s) == 0)
            return;
    v->tok[v->n] = strdup(s);
    v->len[v->n] = (uint32_t)strlen(s);
    v->n++;
}

/* Property names and literal values of the schema become tokens, as a model's vocabulary would
 * hold the pieces it needs. */
static void gv_from_schema(struct gen_vocab *v, json_t *s)
{
    const char *k;
    json_t *x;
    size_t i;
    if (json_is_array(s)) {
        json_array_foreach(s, i, x) gv_from_schema(v, x);
        return;
    }
    if (!json_is_object(s))
        return;
    json_object_foreach(s, k, x) {
        if (strcmp(k, "properties") == 0 && json_is_object(x)) {
            const char *p;
            json_t *ps;
            json_object_foreach(x, p, ps) {
                json_t *js = json_string(p);
                char *q = json_dumps(js, JSON_ENCODE_ANY);
                gv_add(v, q);
                char buf[300];
                snprintf(buf, sizeof buf, "%s:", q);
                gv_add(v, buf);
                free(q);
                json_decref(js);
                gv_from_schema(v, ps);
            }
        } else if (strcmp(k, "const") == 0 || strcmp(k, "enum") == 0) {
            json_t *vals = strcmp(k, "enum") == 0 ? json_incref(x) : json_pack("[O]", x);
            json_array_foreach(vals, i, x) {
                char *q = json_dumps(x, JSON_ENCODE_ANY | JSON_COMPACT);
                gv_add(v, q);
                free(q);
            }
            json_decref(vals);
        } else {
            gv_from_schema(v, x);
        }
    }
}

static const char *gen_base[] = {
    "{", "}", "[", "]", "\"", ":", ",", " ", "\n", "  ", "{\"", "\":", "\",", "\": ", ", ",
    "\"}", "\"]", "true", "false", "null", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "12", "-", ".", "e", "E", "+", "a", "b", "c", "d", "f", "x", "yz", "hello", " world", "é",
    "😀", "\xf0\x9f", "\x98\x80", "\\n", "\\\"", "\\u00e9", "T", "Z", "20", "-0", "1-",
};

static int is_closer(const char *t)
{
    return strcmp(t, "\"") == 0 || strcmp(t, "}") == 0 || strcmp(t, "]") == 0 ||
           strcmp(t, "\"}") == 0 || strcmp(t, "\"]") == 0 || strcmp(t, "0") == 0 ||
           strcmp(t, "null") == 0 || strcmp(t, "true") == 0;
}

TEST_TIMEOUT(grammar_schema_random_generation, 300)
{
    json_t *f = load_fixture();
    json_t *cases = json_object_get(f, "cases"), *c;
    size_t ci;
    int made = 0, unfinished = 0, overflow = 0;
    moe_test_rng_seed(42);
    json_array_foreach(cases, ci, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *schema = json_object_get(c, "schema");
        struct moe_grammar *g = schema_grammar(schema, name);
        struct gen_vocab gv = {0};
        for (size_t i = 0; i < sizeof gen_base / sizeof *gen_base; i++)
            gv_add(&gv, gen_base[i]);
        for (int ch = 1; ch < 256; ch++) /* the byte tokens of a BPE vocabulary */
            gv_add(&gv, (char[]){(char)ch, 0});
        gv_from_schema(&gv, schema);
        gv_add(&gv, "<eos>");
        gv.eog[gv.n - 1] = 1;
        char err[512];
        struct moe_grammar_vocab *v = moe_grammar_vocab_new((const char *const *)gv.tok, gv.len,
                                                            gv.n, gv.eog, err, sizeof err);
        CHECK(v != NULL);
        uint8_t mask[768];
        uint32_t allowed[768];
        for (int walk = 0; walk < 6; walk++) {
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            char out[8192];
            size_t n_out = 0;
            int done = 0;
            for (int step = 0; step < 600 && !done; step++) {
                CHECK(moe_grammar_mask(st, v, mask) >= 0);
                uint32_t n_allowed = 0, n_close = 0, close[768];
                for (uint32_t t = 0; t < gv.n; t++) {
                    if (!mask[t] || gv.eog[t])
                        continue;
                    allowed[n_allowed++] = t;
                    if (is_closer(gv.tok[t]))
                        close[n_close++] = t;
                }
                int can_end = mask[gv.n - 1];
                CHECK_EQ(can_end, moe_grammar_state_is_accepting(st));
                if (can_end && (n_allowed == 0 || moe_test_rng_u32() % 3 == 0 || step > 200)) {
                    done = 1;
                    break;
                }
                CHECK_MSG(n_allowed > 0, "%s: dead end after '%.*s'", name, (int)n_out, out);
                uint32_t t = allowed[moe_test_rng_u32() % n_allowed];
                if (step > 60 && n_close && moe_test_rng_u32() % 4 != 0)
                    t = close[moe_test_rng_u32() % n_close];
                if (n_out + gv.len[t] >= sizeof out)
                    break;
                CHECK_EQ(moe_grammar_state_accept_bytes(st, gv.tok[t], gv.len[t]), 1);
                memcpy(out + n_out, gv.tok[t], gv.len[t]);
                n_out += gv.len[t];
            }
            moe_grammar_state_free(st);
            if (!done) {
                unfinished++;
                continue;
            }
            out[n_out] = '\0';
            json_error_t je;
            json_t *doc = json_loads(out, JSON_DECODE_ANY, &je);
            if (!doc && strstr(je.text, "overflow")) {
                overflow++; /* e.g. 1e999: valid JSON text, out of range for jansson */
                continue;
            }
            CHECK_MSG(doc != NULL, "%s: generated '%s' does not parse: %s", name, out, je.text);
            CHECK_MSG(shape_ok(schema, schema, doc), "%s: generated '%s' does not fit", name,
                      out);
            json_decref(doc);
            made++;
        }
        moe_grammar_vocab_free(v);
        for (uint32_t i = 0; i < gv.n; i++)
            free(gv.tok[i]);
        moe_grammar_free(g);
    }
    fprintf(stderr, "%d documents generated and checked, %d unfinished, %d out of jansson's range\n",
            made, unfinished, overflow);
    CHECK(made >= (int)json_array_size(cases) * 4);
    json_decref(f);
}

/* Mutated fixture schemas: conversion either refuses with a message or gives a grammar that
 * parses and starts. */
TEST(grammar_schema_mini_fuzz)
{
    json_t *f = load_fixture();
    json_t *cases = json_object_get(f, "cases");
    static const char alphabet[] = "{}[]\":,0123456789 -tfnaeiouxyz$#/\\";
    static const char *words[] = {"\"type\"", "\"string\"", "\"object\"", "\"array\"",
                                  "\"items\"", "\"properties\"", "\"required\"", "\"enum\"",
                                  "\"anyOf\"", "\"$ref\"", "\"#/$defs/x\"", "\"null\"",
                                  "\"minItems\"", "\"maxLength\"", "\"additionalProperties\"",
                                  "true", "false", "{}", "[]", "\"format\"", "\"date\"",
                                  "\"minimum\"", "\"exclusiveMaximum\"", "1.5", "-3", "1e300",
                                  "\"pattern\"", "\"^a\"", "(", ")", "|", "*", "\\\\",
                                  "\"prefixItems\"", "[{}]"};
    moe_test_rng_seed(5);
    int converted = 0, refused = 0;
    for (int iter = 0; iter < 40000; iter++) {
        json_t *c = json_array_get(cases, moe_test_rng_u32() % json_array_size(cases));
        char *text = json_dumps(json_object_get(c, "schema"), JSON_COMPACT | JSON_ENCODE_ANY);
        size_t n = strlen(text);
        char *buf = malloc(n + 256);
        memcpy(buf, text, n + 1);
        free(text);
        int muts = 1 + (int)(moe_test_rng_u32() % 3);
        for (int m = 0; m < muts; m++) {
            uint32_t op = moe_test_rng_u32() % 3, at = (uint32_t)(moe_test_rng_u32() % (n + 1));
            if (op == 0 && at < n) {
                buf[at] = alphabet[moe_test_rng_u32() % (sizeof alphabet - 1)];
            } else if (op == 1) { /* at most 3 words of under 32 bytes: buf has room */
                const char *w = words[moe_test_rng_u32() % (sizeof words / sizeof *words)];
                size_t wl = strlen(w);
                memmove(buf + at + wl, buf + at, n - at + 1);
                memcpy(buf + at, w, wl);
                n += wl;
            } else if (at < n) {
                memmove(buf + at, buf + at + 1, n - at);
                n--;
            }
        }
        json_error_t je;
        json_t *s = json_loadb(buf, n, JSON_DECODE_ANY, &je);
        free(buf);
        if (!s)
            continue;
        char err[512] = "", *gbnf = NULL;
        if (moe_json_schema_to_gbnf(s, &gbnf, err, sizeof err) == 0) {
            struct moe_grammar *g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
            CHECK_MSG(g != NULL, "converted grammar does not parse: %s\n%s", err, gbnf);
            struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
            CHECK_MSG(st != NULL, "%s", err);
            moe_grammar_state_free(st);
            moe_grammar_free(g);
            free(gbnf);
            converted++;
        } else {
            CHECK(gbnf == NULL && err[0] != '\0');
            refused++;
        }
        json_decref(s);
    }
    fprintf(stderr, "%d mutated schemas converted, %d refused\n", converted, refused);
    CHECK(converted > 400);
    json_decref(f);
}

/* The Jinja renderer: the 23 real chat templates against jinja2's output (fixtures made by
 * tools/chat-fixtures.py), one small template per feature against jinja2 (tools/jinja-cases.py),
 * provenance of output bytes, errors with lines, limits, and a deterministic mini-fuzz of mutated
 * templates (no crash, no leak under ASan). */
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"
#include "store/err.h"
#include "tests/harness.h"

#define FIXDIR "tests/fixtures/chat-templates"
#define FIXED_NOW 1741944413 /* 2025-03-14 09:26:53 UTC, the fixtures' strftime_now */

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    CHECK_MSG(j, "%s: %s (line %d)", path, je.text, je.line);
    return j;
}

static struct jinja_tmpl *parse_file(const char *name)
{
    char path[512], err[512];
    snprintf(path, sizeof path, FIXDIR "/%s.jinja", name);
    size_t n;
    char *src = moe_test_read_file_or_fail(path, &n);
    struct jinja_tmpl *t;
    int rc = jinja_parse(src, n, &t, err, sizeof err);
    free(src);
    CHECK_MSG(rc == 0, "%s: %s", name, err);
    return t;
}

/* The data variables of one conversation: messages, tools, add_generation_prompt, kwargs. */
static json_t *conv_vars(json_t *c)
{
    json_t *v = json_object();
    json_object_set(v, "messages", json_object_get(c, "messages"));
    json_object_set(v, "tools", json_object_get(c, "tools"));
    json_object_set(v, "add_generation_prompt", json_object_get(c, "add_generation_prompt"));
    json_object_update(v, json_object_get(c, "kwargs"));
    return v;
}

/* Where jinja2 raised UndefinedError, moed's message says what jinja2's does ('x' is undefined,
 * 'dict object' has no attribute 'y', list object has no element 3). */
static bool same_undefined_message(const char *jinja2_error, const char *err)
{
    static const char pre[] = "UndefinedError: ";
    return strncmp(jinja2_error, pre, sizeof pre - 1) || strstr(err, jinja2_error + sizeof pre - 1);
}

static void show_diff(const char *tmpl, const char *conv, const char *want, const char *got)
{
    size_t i = 0;
    while (want[i] && want[i] == got[i])
        i++;
    size_t from = i > 60 ? i - 60 : 0;
    fprintf(stderr, "%s / %s: differs at byte %zu\n  want: %.120s\n  got:  %.120s\n", tmpl, conv, i,
            want + from, got + from);
}

TEST(jinja_real_templates_match_jinja2)
{
    json_t *convs = load_json(FIXDIR "/conversations.json");
    json_t *exp = load_json(FIXDIR "/expected.json");
    const char *tname;
    json_t *tv;
    size_t n_ok = 0, n_err = 0, bad = 0, n_tmpl = 0;
    json_object_foreach(exp, tname, tv) {
        struct jinja_tmpl *t = parse_file(tname);
        n_tmpl++;
        json_t *lit = json_object();
        if (json_is_string(json_object_get(tv, "bos_token")))
            json_object_set(lit, "bos_token", json_object_get(tv, "bos_token"));
        if (json_is_string(json_object_get(tv, "eos_token")))
            json_object_set(lit, "eos_token", json_object_get(tv, "eos_token"));
        size_t i;
        json_t *c;
        json_array_foreach(convs, i, c) {
            const char *cname = json_string_value(json_object_get(c, "name"));
            json_t *want = json_object_get(json_object_get(tv, "cases"), cname);
            CHECK_MSG(want, "%s: no expected output for %s", tname, cname);
            json_t *vars = conv_vars(c);
            struct jinja_opts o = {.now = FIXED_NOW};
            struct jinja_out out;
            char err[512];
            int rc = jinja_render(t, vars, lit, &o, &out, err, sizeof err);
            json_t *wt = json_object_get(want, "text");
            if (wt) {
                if (rc) {
                    fprintf(stderr, "%s / %s: %s\n", tname, cname, err);
                    bad++;
                } else if (out.len != json_string_length(wt) ||
                           memcmp(out.text, json_string_value(wt), out.len)) {
                    show_diff(tname, cname, json_string_value(wt), out.text);
                    bad++;
                } else {
                    n_ok++;
                }
            } else if (rc == 0) {
                fprintf(stderr, "%s / %s: jinja2 raised (%s) but moed rendered\n", tname, cname,
                        json_string_value(json_object_get(want, "error")));
                bad++;
            } else {
                CHECK_MSG(strstr(err, "line ") || rc == MOE_ETOOBIG, "%s / %s: error without a line: %s",
                          tname, cname, err);
                const char *je = json_string_value(json_object_get(want, "error"));
                CHECK_MSG(same_undefined_message(je, err), "%s / %s: jinja2 says %s, moed %s", tname, cname, je, err);
                n_err++;
            }
            if (!rc)
                jinja_out_free(&out);
            json_decref(vars);
        }
        json_decref(lit);
        jinja_free(t);
    }
    fprintf(stderr, "%zu templates: %zu renders identical, %zu errors as in jinja2, %zu bad\n",
            n_tmpl, n_ok, n_err, bad);
    CHECK_EQ(n_tmpl, 23);
    CHECK_EQ(bad, 0);
    json_decref(convs);
    json_decref(exp);
}

/* One template per feature (tests/fixtures/jinja-cases.json, made by tools/jinja-cases.py):
 * moed's output is jinja2's byte for byte, and where jinja2 raised, moed fails with a message. */
TEST(jinja_feature_cases_match_jinja2)
{
    json_t *cases = load_json("tests/fixtures/jinja-cases.json");
    size_t i, n_ok = 0, n_err = 0, bad = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *src = json_string_value(json_object_get(c, "template"));
        json_t *wt = json_object_get(c, "text");
        struct jinja_tmpl *t;
        struct jinja_out out;
        char err[512];
        int rc = jinja_parse(src, strlen(src), &t, err, sizeof err);
        if (rc == 0) {
            struct jinja_opts o = {.now = FIXED_NOW};
            rc = jinja_render(t, json_object_get(c, "data"), NULL, &o, &out, err, sizeof err);
            jinja_free(t);
        }
        if (wt) {
            if (rc) {
                fprintf(stderr, "%s: %s\n", name, err);
                bad++;
            } else if (out.len != json_string_length(wt) || memcmp(out.text, json_string_value(wt), out.len)) {
                show_diff(name, "case", json_string_value(wt), out.text);
                bad++;
            } else {
                n_ok++;
            }
        } else if (rc == 0) {
            fprintf(stderr, "%s: jinja2 raised (%s) but moed rendered [%s]\n", name,
                    json_string_value(json_object_get(c, "error")), out.text);
            bad++;
        } else {
            CHECK_MSG(err[0], "%s: an error without a message", name);
            const char *je = json_string_value(json_object_get(c, "error"));
            CHECK_MSG(same_undefined_message(je, err), "%s: jinja2 says %s, moed %s", name, je, err);
            n_err++;
        }
        if (!rc)
            jinja_out_free(&out);
    }
    fprintf(stderr, "%zu feature cases: %zu identical, %zu errors as in jinja2, %zu bad\n",
            json_array_size(cases), n_ok, n_err, bad);
    CHECK(json_array_size(cases) >= 75);
    CHECK_EQ(bad, 0);
    json_decref(cases);
}

/* Renders src with data {"m": <m_json>} (and bos_token "<s>" as template text). Returns the rc;
 * *out holds the output on success. */
static int render_str(const char *src, const char *data_json, struct jinja_out *out, char *err,
                      size_t errlen, const struct jinja_opts *o)
{
    struct jinja_tmpl *t;
    int rc = jinja_parse(src, strlen(src), &t, err, errlen);
    if (rc)
        return rc;
    json_t *data = data_json ? json_loads(data_json, 0, NULL) : NULL;
    json_t *lit = json_pack("{ss}", "bos_token", "<s>");
    rc = jinja_render(t, data, lit, o, out, err, errlen);
    json_decref(data);
    json_decref(lit);
    jinja_free(t);
    return rc;
}

static char *render_ok(const char *src, const char *data_json)
{
    struct jinja_out out;
    char err[512];
    int rc = render_str(src, data_json, &out, err, sizeof err, NULL);
    CHECK_MSG(rc == 0, "%s: %s", src, err);
    char *s = strdup(out.text);
    jinja_out_free(&out);
    return s;
}

static void expect_render(const char *src, const char *data_json, const char *want)
{
    char *got = render_ok(src, data_json);
    CHECK_MSG(!strcmp(got, want), "%s\n  want [%s]\n  got  [%s]", src, want, got);
    free(got);
}

static void expect_error(const char *src, const char *data_json, int code, const char *needle)
{
    struct jinja_out out;
    char err[512];
    int rc = render_str(src, data_json, &out, err, sizeof err, NULL);
    CHECK_MSG(rc == code, "%s: rc %d, want %d (%s)", src, rc, code, rc ? err : out.text);
    CHECK_MSG(strstr(err, needle), "%s: error '%s' lacks '%s'", src, err, needle);
}

TEST(jinja_expressions_and_statements)
{
    expect_render("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % -3 }}|{{ 1 / 4 }}|{{ 2 ** 10 }}", NULL,
                  "7|3|-4|-2|0.25|1024");
    expect_render("{{ 'a' ~ 1 ~ none }}|{{ [1, 2][-1] }}|{{ 'héllo'[1] }}|{{ 'abcdef'[1:4] }}|{{ [1,2,3][::-1] }}",
                  NULL, "a1None|2|é|bcd|[3, 2, 1]");
    expect_render("{{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1e-7 }} {{ 3.0 * 2 }}", NULL,
                  "1.0 1e+20 0.30000000000000004 1e-07 6.0");
    expect_render("{% for x in [1, 2, 3] if x != 2 %}{{ loop.index }}{{ x }}{{ loop.last }},{% else %}no{% endfor %}",
                  NULL, "11False,23True,");
    expect_render("{% for x in [] %}y{% else %}empty{% endfor %}", NULL, "empty");
    expect_render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", NULL, "a=1;b=2;");
    expect_render("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}"
                  "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", NULL, "3");
    expect_render("{% macro f(a, b='x') %}[{{ a }}{{ b }}]{% endmacro %}{{ f(1) }}{{ f(2, b='y') }}", NULL,
                  "[1x][2y]");
    expect_render("{% set x %}  block  {% endset %}{{ x | trim | upper }}", NULL, "BLOCK");
    expect_render("{% filter upper %}abc{% endfilter %}", NULL, "ABC");
    expect_render("{{ {'b': 1, 'a': [1, 'x', none, true]} | tojson }}", NULL,
                  "{\"b\": 1, \"a\": [1, \"x\", null, true]}");
    expect_render("{{ {'a': {'b': 'é'}} | tojson(indent=2) }}", NULL, "{\n  \"a\": {\n    \"b\": \"é\"\n  }\n}");
    expect_render("{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}{{ 3 is odd }}",
                  NULL, "FalseTrueTrueTrueTrue");
    expect_render("{{ 'a,b,,c'.split(',') }}|{{ '  a b  '.split() }}|{{ 'x'.join(['1','2']) }}|{{ '--a--'.strip('-') }}",
                  NULL, "['a', 'b', '', 'c']|['a', 'b']|1x2|a");
    expect_render("{{ [{'n': 'a', 'k': 1}, {'n': 'b'}] | selectattr('k', 'defined') | map(attribute='n') | join(',') }}",
                  NULL, "a");
    expect_render("{{ ['B', 'a', 'b'] | unique | list }}|{{ [3, 1, 2] | sort }}|{{ {'b': 1, 'a': 2} | dictsort }}",
                  NULL, "['B', 'a']|[1, 2, 3]|[('a', 2), ('b', 1)]");
    expect_render("{{ 'a\nb' | indent(2, first=true) }}|{{ x | default('d') }}|{{ '5' | int + 1 }}", NULL,
                  "  a\n  b|d|6");
    expect_render("{{ 'yes' if 1 > 2 else 'no' }}{{ 'a' in 'cat' }}{{ 2 not in [1] }}{{ 1 < 2 < 3 }}", NULL,
                  "noTrueTrueTrue");
    expect_render("{{ strftime_now('%Y') | length }}", NULL, "4");
    expect_render("  {% if true %}\n  x\n  {% endif %}\n{{- ' y' }}", NULL, "  x\n y");
    expect_render("a  {%- if true -%}  b  {%+ endif %}\nc{# note #}\n  {#- x #}d", NULL, "ab  cd");
}

TEST(jinja_provenance_keeps_data_data)
{
    struct jinja_out out;
    char err[512];
    const char *src = "{{ bos_token }}{{ '<|im_start|>user\\n' + m[0].upper() + '<|im_end|>' }}"
                      "{{ m[0].split('|')[1] | trim }}{{ m | tojson }}";
    CHECK_EQ(render_str(src, "{\"m\": [\"<|im_start|>x\"]}", &out, err, sizeof err, NULL), 0);
    CHECK_EQ(strcmp(out.text, "<s><|im_start|>user\n<|IM_START|>X<|im_end|>im_start[\"<|im_start|>x\"]"), 0);
    /* template text, data, template text, data (the split piece), then the JSON: quotes are
     * template text, the string inside data */
    struct { const char *text; bool data; } want[] = {
        {"<s><|im_start|>user\n", false}, {"<|IM_START|>X", true}, {"<|im_end|>", false},
        {"im_start", true}, {"[\"", false}, {"<|im_start|>x", true}, {"\"]", false},
    };
    CHECK_EQ(out.n_spans, sizeof want / sizeof want[0]);
    for (size_t i = 0; i < out.n_spans; i++) {
        CHECK_EQ(out.spans[i].data, want[i].data);
        CHECK_EQ(out.spans[i].len, strlen(want[i].text));
        CHECK(!memcmp(out.text + out.spans[i].off, want[i].text, out.spans[i].len));
    }
    jinja_out_free(&out);
    /* literal variables cannot be overridden by data ones */
    CHECK_EQ(render_str("{{ bos_token }}", "{\"bos_token\": \"<evil>\"}", &out, err, sizeof err, NULL), 0);
    CHECK_EQ(strcmp(out.text, "<s>"), 0);
    CHECK(!out.spans[0].data);
    jinja_out_free(&out);
    /* formatting, case mapping, call blocks and recursive loops keep data data (the text as
     * jinja2 renders it) */
    const char *src2 = "{{ '<%s|' % m[0] }}{{ '{:>4}>'.format(m[1]) }}{{ m[0] | upper }}"
                       "{% macro w() %}({{ caller() }}){% endmacro %}{% call w() %}{{ m[1] }}{% endcall %}"
                       "{% for x in [m] recursive %}{% if x is string %}{{ x | title }}{% else %}{{ loop(x) }}{% endif %}{% endfor %}";
    CHECK_EQ(render_str(src2, "{\"m\": [\"é<|x|>\", \"ab\"]}", &out, err, sizeof err, NULL), 0);
    CHECK_MSG(!strcmp(out.text, "<é<|x|>|  ab>É<|X|>(ab)É<|x|>Ab"), "%s", out.text);
    struct { const char *text; bool data; } want2[] = {
        {"<", false}, {"é<|x|>", true}, {"|  ", false}, {"ab", true}, {">", false}, {"É<|X|>", true},
        {"(", false}, {"ab", true}, {")", false}, {"É<|x|>Ab", true},
    };
    CHECK_EQ(out.n_spans, sizeof want2 / sizeof want2[0]);
    for (size_t i = 0; i < out.n_spans && i < sizeof want2 / sizeof want2[0]; i++) {
        CHECK_EQ(out.spans[i].data, want2[i].data);
        CHECK_EQ(out.spans[i].len, strlen(want2[i].text));
        CHECK(!memcmp(out.text + out.spans[i].off, want2[i].text, out.spans[i].len));
    }
    jinja_out_free(&out);
}

TEST(jinja_errors_name_construct_and_line)
{
    expect_error("a\n{{ x.y }}", NULL, MOE_EFORMAT, "line 2: 'x' is undefined");
    expect_error("\n\n{{ raise_exception('bad role') }}", NULL, MOE_EFORMAT, "line 3: raise_exception: bad role");
    expect_error("{% if x %}", NULL, MOE_EFORMAT, "missing 'endif'");
    expect_error("x\n{{ 1 + }}", NULL, MOE_EFORMAT, "line 2: unexpected '}}'");
    expect_error("{{ x | frobnicate }}", NULL, MOE_EUNSUPPORTED, "no filter named 'frobnicate'");
    expect_error("{{ x is frob }}", NULL, MOE_EUNSUPPORTED, "no test named 'frob'");
    expect_error("{{ x | wordwrap }}", NULL, MOE_EUNSUPPORTED, "the filter 'wordwrap' is not supported");
    expect_error("{{ 'abc'.casefold() }}", NULL, MOE_EUNSUPPORTED, "str.casefold() is not supported");
    /* in an if, as in jinja2, an unknown name fails only when evaluated */
    expect_render("{% if false %}{{ x | frob }}{% endif %}{{ 1 if true else x is frob }}", NULL, "1");
    expect_error("{% if true %}\n{{ x | frob }}{% endif %}", NULL, MOE_EFORMAT, "line 2: no filter named 'frob'");
    expect_error("{% if false %}{% for x in [] %}\n{{ x | frob }}{% endfor %}{% endif %}", NULL, MOE_EUNSUPPORTED,
                 "line 2: no filter named 'frob'");
    expect_error("\n{% include 'x' %}", NULL, MOE_EUNSUPPORTED, "line 2: the 'include' statement is not supported");
    expect_error("{{ 'a' + 1 }}", NULL, MOE_EFORMAT, "unsupported operand types for +: 'str' and 'int'");
    expect_error("{{ [].append(1) }}", NULL, MOE_EFORMAT, "list.append() modifies the list");
    expect_error("{{ 1 // 0 }}", NULL, MOE_EFORMAT, "division or modulo by zero");
    expect_error("{{ 9223372036854775807 + 1 }}", NULL, MOE_EFORMAT, "integer overflow");
    expect_error("{{ (-8.0) ** 0.5 }}", NULL, MOE_EUNSUPPORTED, "a negative number to a fractional power is complex");
    expect_error("{{ '%*d' % (3, 1) }}", NULL, MOE_EUNSUPPORTED, "'*' widths");
    expect_error("{% for a, b in [1] %}{% endfor %}", NULL, MOE_EFORMAT, "cannot unpack");
    expect_error("{% endfor %}", NULL, MOE_EFORMAT, "unexpected 'endfor'");
    expect_error("{{ 'abc", NULL, MOE_EFORMAT, "unterminated string");
    expect_error("\n{{ '\\N{BULLET}' }}", NULL, MOE_EUNSUPPORTED, "line 2: \\N{...} escapes in string literals are not supported");
    /* a format spec's fill that is not UTF-8 (found by fuzzing): one byte, then an error */
    expect_error("{{ '{:\xbd\xbd\xbd\xbd\xbd\xbd>6.f}'.format(1) }}", NULL, MOE_EFORMAT, "invalid format specifier");
}

TEST(jinja_limits)
{
    expect_error("{% for i in range(100000000) %}{% endfor %}", NULL, MOE_ETOOBIG, "range() of more than");
    struct jinja_opts few = {.max_iterations = 1000};
    struct jinja_out out;
    char err[256];
    CHECK_EQ(render_str("{% for i in range(600) %}{% for j in range(2) %}{% endfor %}{% endfor %}", NULL,
                        &out, err, sizeof err, &few), MOE_ETOOBIG);
    CHECK(strstr(err, "more than 1000 loop iterations"));
    expect_error("{{ 'x' * 100000000 }}", NULL, MOE_ETOOBIG, "output is longer");
    expect_error("{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
                 NULL, MOE_ETOOBIG, "output is longer");
    expect_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", NULL, MOE_ETOOBIG, "macro calls nested");
    expect_error("{% macro m() %}{% call m() %}{{ caller() }}{% endcall %}{% endmacro %}{{ m() }}", NULL,
                 MOE_ETOOBIG, "nested more than");
    expect_error("{% set ns = namespace(t=[]) %}{% for i in range(100) %}{% set ns.t = [ns.t] %}{% endfor %}"
                 "{% for x in ns.t recursive %}{{ loop(x) }}{% endfor %}", NULL, MOE_ETOOBIG, "nested more than");
    expect_error("{{ '%999999d' % 1 }}", NULL, MOE_EUNSUPPORTED, "a format width above");
    expect_error("{{ '{:>999999}'.format(1) }}", NULL, MOE_EUNSUPPORTED, "a format width above");
    expect_error("{{ 'x' | center(999999999) }}", NULL, MOE_ETOOBIG, "a width of");
    expect_error("{% for b in range(600000) | batch(1) %}{% endfor %}", NULL, MOE_ETOOBIG, "loop iterations");
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                 "{{ ns.x | tojson }}", NULL, MOE_EFORMAT, "nested more than");
    char *deep = malloc(3000);
    strcpy(deep, "{{ ");
    for (int i = 0; i < 1000; i++)
        strcat(deep, "(");
    strcat(deep, "1");
    for (int i = 0; i < 1000; i++)
        strcat(deep, ")");
    strcat(deep, " }}");
    expect_error(deep, NULL, MOE_ETOOBIG, "nested more than");
    free(deep);
    /* a long left-leaning chain is parsed in a loop, but evaluated recursively: bounded */
    size_t n = 4 + 2 * 5000 + 8;
    char *chain = malloc(n);
    strcpy(chain, "{{ 1");
    for (int i = 0; i < 5000; i++)
        strcat(chain, "+1");
    strcat(chain, " }}");
    expect_error(chain, NULL, MOE_ETOOBIG, "nested more than");
    free(chain);
    char *big = malloc(JINJA_MAX_TEMPLATE + 2);
    memset(big, 'x', JINJA_MAX_TEMPLATE + 1);
    big[JINJA_MAX_TEMPLATE + 1] = 0;
    struct jinja_tmpl *t;
    CHECK_EQ(jinja_parse(big, JINJA_MAX_TEMPLATE + 1, &t, err, sizeof err), MOE_ETOOBIG);
    free(big);
    struct jinja_opts small = {.max_memory = 1 << 20};
    CHECK_EQ(render_str("{% set ns = namespace(s='') %}{% for i in range(20000) %}{% set ns.s = ns.s + 'abcdefgh' %}"
                        "{% endfor %}{{ ns.s | length }}", NULL, &out, err, sizeof err, &small), MOE_ETOOBIG);
}

static const char *const fuzz_bits[] = {
    "{%", "%}", "{{", "}}", "{#", "#}", "-", "(", ")", "[", "]", "{", "}", "|", "'", "\"", ",", ":",
    ".", "if ", "endif", "for ", "endfor", "in ", "not ", "set ", "=", "macro ", "endmacro", "loop.",
    "tojson", "~", "*", "\n", "\\", "0", "9999999999999999999", "[::-1]", "namespace(", "range(",
    "raise_exception(", " is ", "defined", "messages", "...", "call ", "endcall", "caller(",
    " recursive", "loop(", "%s", "%(", " % ", "%-9.3f", ".format(", "{0", "{:", "{!r:>", "|format(",
    "|batch(", "|slice(", "|groupby(", "|truncate(", "|center(", "|title", "|upper", "filter ",
    "endfilter", "raw %}", "endraw", "with ", "endwith", "varargs", "kwargs", "loop.changed(",
    "*[", "**{", "\xc3\x89", "\xce\xa3", "\xc3",
};

struct fuzz_counts {
    size_t parsed, rendered, total;
};

/* Mutates src (1 to 4 deletions, insertions, byte flips, duplications), then parses and renders
 * it with data: either outcome is fine, a crash or a span that does not cover the output is not. */
static void fuzz_one(const char *src, size_t len, json_t *data, struct fuzz_counts *fc)
{
    char *m = malloc(len + 4096);
    memcpy(m, src, len);
    size_t ml = len;
    int nmut = 1 + (int)(moe_test_rng_u32() % 4);
    for (int k = 0; k < nmut && ml > 0; k++) {
        size_t at = moe_test_rng_u32() % ml;
        switch (moe_test_rng_u32() % 4) {
        case 0: { /* delete a range */
            size_t dl = 1 + moe_test_rng_u32() % 40;
            if (dl > ml - at)
                dl = ml - at;
            memmove(m + at, m + at + dl, ml - at - dl);
            ml -= dl;
            break;
        }
        case 1: { /* insert a token */
            const char *b = fuzz_bits[moe_test_rng_u32() % (sizeof fuzz_bits / sizeof fuzz_bits[0])];
            size_t bl = strlen(b);
            if (ml + bl > len + 4000)
                break;
            memmove(m + at + bl, m + at, ml - at);
            memcpy(m + at, b, bl);
            ml += bl;
            break;
        }
        case 2: /* flip a byte */
            m[at] = (char)(moe_test_rng_u32() & 0xff);
            break;
        default: { /* duplicate a range */
            size_t dl = 1 + moe_test_rng_u32() % 200;
            if (dl > ml - at)
                dl = ml - at;
            if (ml + dl > len + 4000)
                break;
            memmove(m + at + dl, m + at, ml - at);
            memcpy(m + at + dl, m + at, dl);
            ml += dl;
        }
        }
    }
    fc->total++;
    struct jinja_tmpl *t;
    char err[512];
    if (jinja_parse(m, ml, &t, err, sizeof err) == 0) {
        fc->parsed++;
        struct jinja_opts o = {.now = FIXED_NOW, .max_output = 1 << 20, .max_memory = 16 << 20,
                               .max_iterations = 100000};
        struct jinja_out out;
        if (jinja_render(t, data, NULL, &o, &out, err, sizeof err) == 0) {
            fc->rendered++;
            size_t cover = 0;
            for (size_t i = 0; i < out.n_spans; i++) {
                CHECK_EQ(out.spans[i].off, cover);
                cover += out.spans[i].len;
            }
            CHECK_EQ(cover, out.len);
            jinja_out_free(&out);
        } else {
            CHECK(err[0]);
        }
        jinja_free(t);
    } else {
        CHECK(err[0]);
    }
    free(m);
}

/* Mutated real templates and feature cases through parse and render: any outcome but a crash
 * (ASan builds check memory too). Deterministic: the same mutations every run. */
TEST_TIMEOUT(jinja_mini_fuzz, 300)
{
    json_t *convs = load_json(FIXDIR "/conversations.json");
    json_t *cases = load_json("tests/fixtures/jinja-cases.json");
    DIR *d = opendir(FIXDIR);
    CHECK(d);
    struct dirent *de;
    moe_test_rng_seed(20250314);
    struct fuzz_counts fc = {0};
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        if (nl < 7 || strcmp(de->d_name + nl - 6, ".jinja"))
            continue;
        char path[512];
        snprintf(path, sizeof path, FIXDIR "/%s", de->d_name);
        size_t len;
        char *src = moe_test_read_file_or_fail(path, &len);
        for (int it = 0; it < 40; it++) {
            json_t *vars = conv_vars(json_array_get(convs, (size_t)it % json_array_size(convs)));
            fuzz_one(src, len, vars, &fc);
            json_decref(vars);
        }
        free(src);
    }
    closedir(d);
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *src = json_string_value(json_object_get(c, "template"));
        for (int it = 0; it < 20; it++)
            fuzz_one(src, strlen(src), json_object_get(c, "data"), &fc);
    }
    fprintf(stderr, "%zu mutated templates: %zu parsed, %zu rendered\n", fc.total, fc.parsed, fc.rendered);
    CHECK(fc.total >= 23 * 40 + 75 * 20);
    json_decref(cases);
    json_decref(convs);
}
